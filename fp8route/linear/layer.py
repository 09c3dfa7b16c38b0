"""Fp8Linear: a static per-tensor FP8 linear layer that runs whatever its plan says."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fp8route.backends.base import LAYOUTS, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.device import DeviceInfo
from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.kernels.options import kernel_options, launch_generation
from fp8route.linear.plan import Plan, Preference, make_plan
from fp8route.linear.policy import Policy
from fp8route.quant import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    as_scale,
    check_finite,
    check_float,
    check_fp8_finite,
    check_fp8_weight,
    quantize_per_tensor,
    requantize_shards,
)

ScaleLike = torch.Tensor | float

_epoch = [0]  # bumped by every replan or move of any Fp8Linear
_GATED_DTYPES = (torch.bfloat16, torch.float16)  # what a fused SiLU * up reads (fp8_gemv's x dtypes)


def plans_epoch() -> int:
    """A number that changes whenever some Fp8Linear's plan or prepared operands are rebuilt, or the
    options of fp8route's kernels change (set_kernel_options): what captured CUDA graphs replay is stale
    once it moves (fp8route.engine.decode_graphs)."""
    return _epoch[0] + launch_generation()  # both only grow: the sum moves when either does


class Fp8Linear(nn.Module):
    """y = (quant(x / input_scale) @ weight.T) * input_scale * weight_scale + bias, in x's dtype.

    weight is float8_e4m3fn [N, K]; weight_scale and input_scale are fp32 scalars (input_scale
    None means a dynamic per-tensor scale computed from each x). The plan is made when the
    layer is built and again when it moves to another device, never in forward. The constructor
    checks the scales' values but not the weight's or the bias's (a placeholder may be filled
    later); from_quantized and from_float, the entry points for tensors from elsewhere, refuse
    NaN and Inf in those too.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: ScaleLike,
        input_scale: ScaleLike | None = None,
        bias: torch.Tensor | None = None,
        *,
        name: str = "fp8_linear",
        logical_widths: Sequence[int] | None = None,
        policy: Policy | None = None,
        preference: Preference | None = None,
    ) -> None:
        super().__init__()
        check_fp8_weight(f"{name}.weight", weight)
        n, k = weight.shape
        if bias is not None:
            check_float(f"{name}.bias", bias)
            if tuple(bias.shape) != (n,):
                raise Fp8InputError(
                    f"{name}.bias: expected shape ({n},) to match weight [N={n}, K={k}], got {tuple(bias.shape)}"
                )
            bias = bias.detach().to(weight.device)
        widths = tuple(logical_widths) if logical_widths is not None else (n,)
        if sum(widths) != n or any(w <= 0 for w in widths):
            raise Fp8InputError(f"{name}: logical widths {list(widths)} must be positive and sum to N={n}")
        self.name = name
        self.in_features, self.out_features = k, n
        self.logical_widths = widths
        self.policy = policy or Policy.from_env()
        self.preference = preference
        self.requant_error: float = 0.0
        self.register_buffer("weight", weight.detach())
        self.register_buffer("weight_scale", as_scale(f"{name}.weight_scale", weight_scale, weight.device))
        scale = None if input_scale is None else as_scale(f"{name}.input_scale", input_scale, weight.device)
        self.register_buffer("input_scale", scale)
        self.register_buffer("bias", bias)
        self.replan()

    @classmethod
    def from_quantized(
        cls,
        qweight: torch.Tensor,
        weight_scale: ScaleLike | Sequence[ScaleLike],
        input_scale: ScaleLike | Sequence[ScaleLike] | None,
        bias: torch.Tensor | None = None,
        logical_widths: Sequence[int] | None = None,
        **kwargs: object,
    ) -> Fp8Linear:
        """A layer from checkpoint tensors. Per-shard scales (one per logical width) are
        requantized to their max, and the max of per-shard input scales is taken."""
        name = str(kwargs.get("name", "fp8_linear"))
        check_fp8_weight(f"{name}.weight", qweight)
        check_fp8_finite(f"{name}.weight", qweight)
        if bias is not None:
            check_float(f"{name}.bias", bias)
            check_finite(f"{name}.bias", bias)
        requant_error = 0.0
        if isinstance(weight_scale, (list, tuple)):
            if logical_widths is None:
                raise Fp8InputError(
                    f"{name}: {len(weight_scale)} shard weight scales need logical_widths (the rows of each shard)"
                )
            fused = requantize_shards(qweight, weight_scale, logical_widths)
            qweight, weight_scale, requant_error = fused.weight, fused.scale, fused.rel_error
        if isinstance(input_scale, (list, tuple)):
            scales = [as_scale(f"{name}.input_scale[{i}]", s) for i, s in enumerate(input_scale)]
            input_scale = torch.stack(scales).max()
        layer = cls(qweight, weight_scale, input_scale, bias, logical_widths=logical_widths, **kwargs)  # type: ignore[arg-type]
        layer.requant_error = requant_error
        return layer

    @classmethod
    def from_float(
        cls, linear_or_weight: nn.Linear | torch.Tensor, input_scale: ScaleLike | None = None, **kwargs: object
    ) -> Fp8Linear:
        """Quantize a float nn.Linear (or weight [N, K]) per tensor: scale = amax / 448."""
        if isinstance(linear_or_weight, nn.Linear):
            weight, bias = linear_or_weight.weight, linear_or_weight.bias
        elif isinstance(linear_or_weight, torch.Tensor):
            weight, bias = linear_or_weight, None
        else:
            raise Fp8TypeError(
                f"from_float: expected an nn.Linear or a weight tensor, got {type(linear_or_weight).__name__}"
            )
        check_float("weight", weight)
        if weight.dim() != 2:
            raise Fp8InputError(f"from_float: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
        name = str(kwargs.get("name", "fp8_linear"))
        qweight, scale = quantize_per_tensor(weight.detach(), name=f"{name}.weight")
        if bias is not None:
            check_finite(f"{name}.bias", bias.detach())
        return cls(qweight, scale, input_scale, None if bias is None else bias.detach(), **kwargs)  # type: ignore[arg-type]

    @property
    def plan(self) -> Plan:
        return self._plan

    def replan(
        self, policy: Policy | None = None, preference: Preference | None = None, device: DeviceInfo | None = None
    ) -> Plan:
        """Plan for the device the weight is on (or, for tests and what-ifs, the one given) and
        prepare the operand layouts the plan reads."""
        self.policy = policy or self.policy
        self.preference = preference or self.preference
        problem = GemmProblem(
            n=self.out_features,
            k=self.in_features,
            device=device or DeviceInfo.of(self.weight.device),
            has_bias=self.bias is not None,
            static_input_scale=self.input_scale is not None,
        )
        self._plan = make_plan(self.name, problem, self.policy, self.preference)
        for backend in self._plan.backends:
            backend.prepare(self.weight.device)
        self.prepared = self.operands(self._plan.layouts)
        _epoch[0] += 1
        return self._plan

    def operands(self, layouts: frozenset[str] = LAYOUTS) -> LinearOperands:
        """What a backend reads, in the layouts named (every layout by default: what a benchmark
        that runs every backend on this layer needs)."""
        return LinearOperands.prepare(self.weight, self.weight_scale, self.input_scale, self.bias, layouts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise Fp8InputError(
                f"{self.name}: x's last dim must be K={self.in_features}, got x of shape {tuple(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise Fp8TypeError(f"{self.name}: x must be bfloat16, float16 or float32, got {x.dtype}")
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = self._plan.backend_for(x2d.shape[0], x.dtype).run(x2d, self.prepared)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This layer on SiLU(gate) * up for gate_up [..., 2K] (gate, then up), the product computed
        inside the GEMM: when the kernel option silu_in_down is on and the backend the plan runs at
        this M does that (fp8route.kernels.options). None otherwise: the caller computes
        the product and calls the layer, as it would without this."""
        if not kernel_options().silu_in_down or gate_up.dtype not in _GATED_DTYPES:
            return None
        if gate_up.dim() == 0 or gate_up.shape[-1] != 2 * self.in_features:
            raise Fp8InputError(
                f"{self.name}: gate_up's last dim must be 2K={2 * self.in_features}, got {tuple(gate_up.shape)}"
            )
        rows = gate_up.reshape(-1, 2 * self.in_features)
        if rows.shape[0] == 0:
            return None
        backend = self._plan.backend_for(rows.shape[0], gate_up.dtype)
        if not backend.fuses_silu_mul:
            return None
        return backend.run_silu_mul(rows, self.prepared).reshape(*gate_up.shape[:-1], self.out_features)

    def forward_quantized(self, x_q: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The GEMM alone, for x already quantized with this layer's input_scale upstream (fused
        into the norm or activation kernel that produced it, as serving engines do), routed by the
        plan's routes for pre-quantized input (`fp8route tune --x-quantized`; without them, those
        of an out_dtype x); the result is in out_dtype."""
        if self.input_scale is None:
            raise Fp8InputError(
                f"{self.name}: forward_quantized needs a static input_scale (this layer computes one "
                "from each x, so a pre-quantized x has no scale it could trust); call the layer on x"
            )
        if x_q.dtype != FP8_DTYPE:
            raise Fp8TypeError(f"{self.name}: forward_quantized takes float8_e4m3fn x, got {x_q.dtype}")
        if out_dtype not in FLOAT_DTYPES:
            raise Fp8TypeError(f"{self.name}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
        if x_q.dim() == 0 or x_q.shape[-1] != self.in_features:
            raise Fp8InputError(
                f"{self.name}: x's last dim must be K={self.in_features}, got x of shape {tuple(x_q.shape)}"
            )
        x2d = x_q.reshape(-1, self.in_features)
        if x2d.shape[0] == 0:
            return x_q.new_empty(*x_q.shape[:-1], self.out_features, dtype=out_dtype)
        backend = self._plan.backend_for(x2d.shape[0], out_dtype, x_quantized=True)
        out = backend.run_quantized(x2d, self.input_scale, self.prepared, out_dtype)
        return out.reshape(*x_q.shape[:-1], self.out_features)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        # module.to(dtype) would cast the fp8 weight and the fp32 scales; they keep their dtype
        # and follow only device moves. A new device gets a new plan.
        keep = {id(t) for t in (self.weight, self.weight_scale, self.input_scale) if t is not None}

        def move(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(moved.device) if id(t) in keep and moved.dtype != t.dtype else moved

        device = self.weight.device
        super()._apply(move, recurse)
        if self.weight.device != device:
            self.replan()
        else:
            self.prepared = self.operands(self._plan.layouts)
            _epoch[0] += 1
        return self

    def extra_repr(self) -> str:
        scale = "static" if self.input_scale is not None else "dynamic"
        has_bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}, input_scale={scale}"
