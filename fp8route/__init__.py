"""fp8route: static per-tensor FP8 linear layers, each routed to the GEMM kernel that wins."""

from fp8route.backends import BACKENDS, Backend, get_backend
from fp8route.checkpoint import Checkpoint, load_checkpoint
from fp8route.errors import (
    BackendUnavailableError,
    CheckpointError,
    Fp8InputError,
    Fp8RouteError,
    Fp8TypeError,
    StrictModeError,
)
from fp8route.explain import explain
from fp8route.layer import Fp8Linear
from fp8route.plan import M_BOUNDS, Plan, make_plan
from fp8route.policy import Policy
from fp8route.problem import DeviceInfo, GemmProblem
from fp8route.quant import dequantize, quantize_per_tensor, requantize_shards, sqnr_db
from fp8route.quantize_checkpoint import quantize_checkpoint
from fp8route.routing import RoutingTable, Tuner, load_table, route

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "M_BOUNDS",
    "Backend",
    "BackendUnavailableError",
    "Checkpoint",
    "CheckpointError",
    "DeviceInfo",
    "Fp8InputError",
    "Fp8Linear",
    "Fp8RouteError",
    "Fp8TypeError",
    "GemmProblem",
    "Plan",
    "Policy",
    "RoutingTable",
    "StrictModeError",
    "Tuner",
    "dequantize",
    "explain",
    "get_backend",
    "load_checkpoint",
    "load_table",
    "make_plan",
    "quantize_checkpoint",
    "quantize_per_tensor",
    "requantize_shards",
    "route",
    "sqnr_db",
]
