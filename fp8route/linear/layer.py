"""Fp8Linear: an FP8 linear layer of any scheme (per-tensor, per-channel, 128x128 blocks) that runs
whatever its plan says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from fp8route.backends.base import LAYOUTS, Backend, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.device import DeviceInfo
from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.kernels.fused_quantize import QuantizedX, XQuant
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
from fp8route.schemes import BLOCK, DESCRIPTION, Scheme, check_scheme, check_weight_scale, quantize_weight

ScaleLike = torch.Tensor | float

_epoch = [0]  # bumped by every replan or move of any Fp8Linear
_HALF_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels fused before or into a GEMM read


def plans_epoch() -> int:
    """A number that changes whenever some Fp8Linear's plan or prepared operands are rebuilt, or the
    options of fp8route's kernels change (set_kernel_options): what captured CUDA graphs replay is stale
    once it moves (fp8route.engine.decode_graphs)."""
    return _epoch[0] + launch_generation()  # both only grow: the sum moves when either does


class Fp8Linear(nn.Module):
    """y = (quant(x / input_scale) @ weight.T) * input_scale * weight_scale + bias, in x's dtype, with
    the scales of the layer's scheme (fp8route.schemes).

    weight is float8_e4m3fn [N, K]. scheme "tensor": weight_scale and input_scale are fp32 scalars
    (input_scale None means a dynamic per-tensor scale computed from each x). "channel": weight_scale
    is [N] (or [N, 1]), x is quantized per token. "block": weight_scale is [ceil(N/128),
    ceil(K/128)], x is quantized per 1x128 group. The dynamic schemes take no input_scale. The plan
    is made when the layer is built and again when it moves to another device, never in forward.
    The constructor checks the scales' values but not the weight's or the bias's (a placeholder may
    be filled later); from_quantized and from_float, the entry points for tensors from elsewhere,
    refuse NaN and Inf in those too.
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
        scheme: Scheme = "tensor",
        name: str = "fp8_linear",
        logical_widths: Sequence[int] | None = None,
        policy: Policy | None = None,
        preference: Preference | None = None,
    ) -> None:
        super().__init__()
        check_scheme(scheme)
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
        self.scheme = scheme
        self.in_features, self.out_features = k, n
        self.logical_widths = widths
        self.policy = policy or Policy.from_env()
        self.preference = preference
        self.requant_error: float = 0.0
        self.register_buffer("weight", weight.detach())
        self.register_buffer("weight_scale", _weight_scale(name, weight_scale, scheme, n, k, weight.device))
        if input_scale is not None and scheme != "tensor":
            raise Fp8InputError(
                f"{name}: the {scheme} scheme quantizes x dynamically ({DESCRIPTION[scheme]}); it takes no input_scale"
            )
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
        """A layer from checkpoint tensors. Per-shard scales (one per logical width): per-tensor ones
        are requantized to their max, and the max of per-shard input scales is taken; per-channel and
        block ones are concatenated (each shard but the last a whole number of 128-row blocks)."""
        name = str(kwargs.get("name", "fp8_linear"))
        scheme = check_scheme(str(kwargs.get("scheme", "tensor")))
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
            if scheme == "tensor":
                fused = requantize_shards(qweight, weight_scale, logical_widths)
                qweight, weight_scale, requant_error = fused.weight, fused.scale, fused.rel_error
            else:
                weight_scale = _concat_scales(name, weight_scale, logical_widths, scheme, qweight)
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
        """Quantize a float nn.Linear (or weight [N, K]) in kwargs' scheme (default per tensor): scale =
        amax / 448 of the tensor, of each row or of each 128x128 block."""
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
        scheme = check_scheme(str(kwargs.get("scheme", "tensor")))
        if scheme == "tensor":
            qweight, scale = quantize_per_tensor(weight.detach(), name=f"{name}.weight")
        else:
            check_finite(f"{name}.weight", weight.detach())
            qweight, scale = quantize_weight(weight.detach(), scheme)
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
            scheme=self.scheme,
        )
        self._plan = make_plan(self.name, problem, self.policy, self.preference)
        for backend in self._plan.backends:
            backend.prepare(self.weight.device)
        self._prepare()
        return self._plan

    def _prepare(self) -> None:
        """What forward reads beside the plan, from the tensors as they are now: each backend's ask of
        x (with the layer's input_scale) and the operand layouts; graphs captured before are stale."""
        self._x_quants = {b.name: self._x_quant_of(b) for b in self._plan.backends}
        self.prepared = self.operands(self._plan.layouts)
        _epoch[0] += 1

    @property
    def upstream_quantized(self) -> tuple[str, ...]:
        """The plan's backends that take x quantized by the kernel before the layer (x_quant)."""
        return tuple(name for name, spec in self._x_quants.items() if spec is not None)

    def _x_quant_of(self, backend: Backend) -> XQuant | None:
        spec = backend.x_quant(self.scheme)
        if spec is None or self.scheme != "tensor":
            return spec
        return None if self.input_scale is None else replace(spec, input_scale=self.input_scale)

    def operands(self, layouts: frozenset[str] = LAYOUTS) -> LinearOperands:
        """What a backend reads, in the layouts named (every layout by default: what a benchmark
        that runs every backend on this layer needs)."""
        return LinearOperands.prepare(self.weight, self.weight_scale, self.input_scale, self.bias, layouts, self.scheme)

    def forward(self, x: torch.Tensor | QuantizedX) -> torch.Tensor:
        """x [..., K] -> [..., N]. x may come quantized by the kernel that made it, as x_quant asked."""
        if isinstance(x, QuantizedX):
            backend = self._plan.backend_for(x.rows, x.dtype)
            out = backend.run_quantized(x.q, x.scale, self.prepared, x.dtype)[: x.rows]
            return out.reshape(*x.shape[:-1], self.out_features)
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

    def x_quant(self, m: int, dtype: torch.dtype) -> XQuant | None:
        """How the backend this layer runs for M rows of dtype x reads an x quantized by the kernel
        before it (forward takes the QuantizedX): with the static input_scale, per token or per 1x128
        group as the scheme says; None where that backend quantizes x itself, or where the scale is a
        dynamic per-tensor one (the whole batch's amax, which no row's kernel knows); None too while the
        kernel option quantize_upstream is off."""
        if not kernel_options().quantize_upstream or m < 1 or dtype not in _HALF_DTYPES:
            return None
        return self._x_quants[self._plan.backend_for(m, dtype).name]

    def forward_quantized(self, x_q: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The GEMM alone, for x already quantized with this layer's input_scale upstream (fused
        into the norm or activation kernel that produced it, as serving engines do), routed by the
        plan's routes for pre-quantized input (`fp8route tune --x-quantized`; without them, those
        of an out_dtype x); the result is in out_dtype."""
        if self.input_scale is None:
            per = {"tensor": "", "channel": " per token", "block": " per 1x128 group"}[self.scheme]
            raise Fp8InputError(
                f"{self.name}: forward_quantized needs a static input_scale (this layer computes its scales{per} "
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
            self._prepare()
        return self

    def extra_repr(self) -> str:
        scale = "static" if self.input_scale is not None else "dynamic"
        has_bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}, "
            f"scheme={self.scheme}, input_scale={scale}"
        )


def _weight_scale(name: str, scale: ScaleLike, scheme: Scheme, n: int, k: int, device: torch.device) -> torch.Tensor:
    if scheme == "tensor":
        return as_scale(f"{name}.weight_scale", scale, device)
    if not isinstance(scale, torch.Tensor):
        raise Fp8TypeError(f"{name}.weight_scale: the {scheme} scheme needs a tensor of scales, got {scale!r}")
    return check_weight_scale(f"{name}.weight_scale", scale, scheme, n, k).to(device)


def _concat_scales(
    name: str, scales: Sequence[ScaleLike], widths: Sequence[int], scheme: Scheme, weight: torch.Tensor
) -> torch.Tensor:
    """The fused layer's scales from its shards' (channel: rows; block: 128-row blocks, so every
    shard but the last must be a whole number of blocks: a block may not straddle two shards)."""
    if len(scales) != len(widths):
        raise Fp8InputError(f"{name}: {len(scales)} shard weight scales for {len(widths)} logical widths")
    if scheme == "block" and any(w % BLOCK for w in widths[:-1]):
        raise Fp8InputError(
            f"{name}: shards of {list(widths)} rows cannot share 128x128 weight blocks ({BLOCK} does not divide "
            "every shard but the last); keep them as separate layers"
        )
    k, device = weight.shape[1], weight.device
    parts = [_weight_scale(f"{name}[{i}]", s, scheme, w, k, device) for i, (s, w) in enumerate(zip(scales, widths))]
    return torch.cat(parts)
