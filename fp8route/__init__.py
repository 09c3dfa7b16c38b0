"""fp8route: static per-tensor FP8 linear layers, each routed to the GEMM kernel that measures fastest.

The data flows checkpoint -> linear -> plan -> backend -> kernel: `checkpoint` reads and writes FP8
checkpoints, `linear` holds the layer and its plan, `backends` the GEMMs a plan can choose,
`kernels` fp8route's own Triton kernels (the decode GEMM among them), `routing` the measured tables
plans follow, `tuning` the measurements that make them, `models` the model runner, `cli` the command.
"""

from fp8route.backends import BACKENDS, Backend, get_backend
from fp8route.backends.problem import GemmProblem
from fp8route.checkpoint.load import Checkpoint, load_checkpoint
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.device import DeviceInfo
from fp8route.engine import LLM, EngineConfig, RequestOutput, SamplingParams, load_model
from fp8route.errors import (
    BackendUnavailableError,
    CheckpointError,
    Fp8InputError,
    Fp8RouteError,
    Fp8TypeError,
    StrictModeError,
)
from fp8route.kernels.options import KernelOptions, set_kernel_options
from fp8route.linear.explain import explain
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.plan import M_BOUNDS, Plan, make_plan
from fp8route.linear.policy import Policy
from fp8route.quant import dequantize, quantize_per_tensor, requantize_shards, sqnr_db
from fp8route.routing import RoutingTable, load_table, route
from fp8route.version import __version__

__all__ = [
    "BACKENDS",
    "LLM",
    "M_BOUNDS",
    "Backend",
    "BackendUnavailableError",
    "Checkpoint",
    "CheckpointError",
    "DeviceInfo",
    "EngineConfig",
    "Fp8InputError",
    "Fp8Linear",
    "Fp8RouteError",
    "Fp8TypeError",
    "GemmProblem",
    "KernelOptions",
    "Plan",
    "Policy",
    "RequestOutput",
    "RoutingTable",
    "SamplingParams",
    "StrictModeError",
    "__version__",
    "dequantize",
    "explain",
    "get_backend",
    "load_checkpoint",
    "load_model",
    "load_table",
    "make_plan",
    "quantize_checkpoint",
    "quantize_per_tensor",
    "requantize_shards",
    "route",
    "set_kernel_options",
    "sqnr_db",
]
