"""A checkpoint's tensors sorted into FP8 linears, KV-cache scales and plain tensors, checked
from the shard headers alone (names, dtypes, shapes) before any data is read.

Every format names an FP8 linear's tensors after its module: `<module>.weight` (e4m3 [N, K]), its
weight scale (`weight_scale`, or `weight_scale_inv` in quant_method fp8 block checkpoints), an
`input_scale` when the scheme's input scale is static, and an optional `bias`; what each scale's shape
is per scheme, fp8route.checkpoint.scales checks. compressed-tensors may add all-zero
`weight_zero_point` / `input_zero_point`; KV-cache scales are `<attn>.k_scale` / `<attn>.v_scale`
(ModelOpt writes them on k_proj / v_proj).

q/k/v and gate/up fuse into one layer when all are FP8 and read the same input; in a block
checkpoint only when every member but the last is a whole number of 128-row blocks (a block may not
straddle two members), else they stay apart, as the model runs them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fp8route.checkpoint.formats import QuantScheme
from fp8route.checkpoint.scales import FLOAT_SCALE_DTYPES, SCALE_NAMES, check_scalar, check_scales
from fp8route.checkpoint.shards import ShardSet, TensorInfo
from fp8route.errors import CheckpointError
from fp8route.schemes import BLOCK

LINEAR_PARTS = ("weight", *SCALE_NAMES, "input_scale", "bias", "weight_zero_point", "input_zero_point")
KV_PARTS = ("k_scale", "v_scale")
# Modules that are not linears, whose 2-D weights stay in full precision by design.
_UNQUANTIZED_2D = re.compile(r"(^|\.)(\w*embed\w*|wte|wpe)$")
# Tensors of quantization schemes other than fp8route's three FP8 ones, on modules that are not FP8 linears.
_FOREIGN = frozenset(
    {
        "weight_scale_2",
        "weight_global_scale",
        "input_global_scale",
        "weight_packed",
        "weight_shape",
        "weight_g_idx",
        "weight_zero_point",
        "input_zero_point",
        "pre_quant_scale",
        "output_scale",
        "q_scale",
        "prob_scale",
    }
)
# (fused name, member names): one GEMM for the projections that read the same input.
FUSIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


@dataclass
class LinearRecord:
    name: str
    parts: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def weight(self) -> TensorInfo:
        return self.parts["weight"]

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]


@dataclass(frozen=True)
class Layout:
    scheme: QuantScheme  # what the config says, which the tensors were checked against
    linears: dict[str, LinearRecord]  # module name -> its FP8 tensors
    fused: dict[str, tuple[str, ...]]  # fused name -> member module names (empty when fuse=False)
    kv_scales: dict[str, TensorInfo]  # canonical name `<attn>.k_scale` -> tensor
    plain: dict[str, TensorInfo]  # everything loaded as it is
    excluded: tuple[str, ...]  # modules with a 2-D weight that the config leaves unquantized

    def owner(self) -> dict[str, str]:
        """Tensor name -> the linear (or fused linear) it belongs to."""
        group = {member: fused for fused, members in self.fused.items() for member in members}
        return {
            info.name: group.get(rec.name, rec.name) for rec in self.linears.values() for info in rec.parts.values()
        }


def natural_key(name: str) -> list[object]:
    """layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def layout(shards: ShardSet, scheme: QuantScheme, fuse: bool = True) -> Layout:
    modules: dict[str, dict[str, TensorInfo]] = {}
    for info in shards.tensors.values():
        module, _, leaf = info.name.rpartition(".")
        modules.setdefault(module, {})[leaf] = info
    linears: dict[str, LinearRecord] = {}
    kv_scales: dict[str, TensorInfo] = {}
    plain: dict[str, TensorInfo] = {}
    excluded: list[str] = []
    for module in sorted(modules, key=natural_key):
        parts = modules[module]
        weight = parts.get("weight")
        scaled = any(leaf in parts for leaf in (*SCALE_NAMES, "input_scale"))
        if scaled or (weight is not None and weight.dtype.startswith("F8")):
            linears[module] = _check_linear(module, parts, scheme)
            parts = {leaf: info for leaf, info in parts.items() if leaf not in LINEAR_PARTS}
        elif weight is not None and len(weight.shape) == 2 and not _UNQUANTIZED_2D.search(module):
            if not scheme.excludes(module):
                raise CheckpointError(
                    f"{scheme.source} says FP8 ({scheme.format}) but {weight.where} is {weight.dtype_name} with no "
                    f"weight_scale, and {module} is not in the config's exclusions; a quantized checkpoint was "
                    "expected (or add the module to exclude_modules/ignore)"
                )
            excluded.append(module)
        for leaf, info in parts.items():
            if leaf in KV_PARTS:
                check_scalar(info)
                kv_scales[_kv_name(module, leaf)] = info
            elif leaf in _FOREIGN:
                raise CheckpointError(
                    f"unsupported: tensor {info.where} (shape {list(info.shape)}, {info.dtype_name}) belongs to a "
                    "quantization scheme other than FP8 (e4m3 weights scaled per tensor, channel or 128x128 block)"
                )
            else:
                plain[info.name] = info
    if not linears:
        raise CheckpointError(
            f"{scheme.source} says FP8 ({scheme.format}) but no tensor in {shards.folder} is float8_e4m3fn"
        )
    fused = _fusions(linears, scheme) if fuse else {}
    return Layout(scheme, linears, fused, kv_scales, plain, tuple(excluded))


def _check_linear(module: str, parts: dict[str, TensorInfo], scheme: QuantScheme) -> LinearRecord:
    some = next(iter(parts.values()))
    weight = parts.get("weight")
    if weight is None:
        raise CheckpointError(f"missing {module}.weight: {some.where} is there but the weight is in no shard")
    if weight.dtype != "F8_E4M3":
        raise CheckpointError(f"{weight.where}: expected dtype float8_e4m3fn (it has scales), got {weight.dtype_name}")
    if len(weight.shape) != 2:
        raise CheckpointError(f"{weight.where}: expected a 2-D [N, K] weight, got shape {list(weight.shape)}")
    if scheme.excludes(module):
        raise CheckpointError(
            f"{weight.where} is float8_e4m3fn but {scheme.source} excludes {module} from quantization"
        )
    check_scales(module, parts, weight, scheme)
    bias = parts.get("bias")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype not in FLOAT_SCALE_DTYPES):
        raise CheckpointError(
            f"{bias.where}: expected a float bias of shape [{weight.shape[0]}] to match {weight.where} "
            f"{list(weight.shape)}, got {bias.dtype_name} {list(bias.shape)}"
        )
    return LinearRecord(module, {leaf: info for leaf, info in parts.items() if leaf in LINEAR_PARTS})


def _kv_name(module: str, leaf: str) -> str:
    for proj in (".k_proj", ".v_proj"):
        if module.endswith(proj):
            module = module[: -len(proj)]
    return f"{module}.{leaf}"


def _fusions(linears: dict[str, LinearRecord], scheme: QuantScheme) -> dict[str, tuple[str, ...]]:
    fused: dict[str, tuple[str, ...]] = {}
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        for fused_leaf, members in FUSIONS:
            if leaf != members[0]:
                continue
            names = tuple(f"{parent}.{m}" if parent else m for m in members)
            if _fusible([linears.get(n) for n in names], scheme):
                fused[f"{parent}.{fused_leaf}" if parent else fused_leaf] = names
    return fused


def _fusible(records: list[LinearRecord | None], scheme: QuantScheme) -> bool:
    """Members must all be FP8 and read the same input (a bias on some only is padded with zeros); in a
    block checkpoint no 128-row block may straddle two members."""
    present = [r for r in records if r is not None]
    if len(present) != len(records) or len({r.k for r in present}) != 1:
        return False
    return scheme.fp8_scheme != "block" or all(r.n % BLOCK == 0 for r in present[:-1])
