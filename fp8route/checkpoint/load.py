"""Read a checkpoint folder: an FP8 one of any scheme (every tensor checked, every quantized linear an
Fp8Linear of the checkpoint's scheme) or a plain float one (read_plain)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8route.checkpoint.config_check import ModelDims, check_config
from fp8route.checkpoint.formats import CONFIG, QuantScheme, detect_scheme, modelopt, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.checkpoint.layout import Layout, layout, natural_key
from fp8route.checkpoint.scales import SCALE_NAMES
from fp8route.checkpoint.sharding import ScaleSlices
from fp8route.checkpoint.shards import ShardSet, Slices, TensorInfo
from fp8route.device import default_device
from fp8route.errors import CheckpointError, Fp8InputError, Fp8TypeError
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.plan import Preference
from fp8route.linear.policy import Policy
from fp8route.quant import as_scale, check_finite, check_fp8_finite
from fp8route.schemes import Scheme

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Checkpoint:
    path: Path
    scheme: QuantScheme
    config: dict[str, Any]  # the parsed config.json
    linears: dict[str, Fp8Linear]  # module name (fused: `...self_attn.qkv_proj`) -> layer
    tensors: dict[str, torch.Tensor]  # every tensor that is not part of a quantized linear
    kv_scales: dict[str, torch.Tensor]  # `<attn>.k_scale` / `<attn>.v_scale`, fp32 scalars
    excluded: tuple[str, ...]  # modules the config leaves unquantized
    fused: dict[str, tuple[str, ...]]  # fused layer -> the checkpoint modules it replaces
    dims: ModelDims | None = None  # the config's sizes, checked against the tensors (None: not a checked architecture)

    @property
    def format(self) -> str:
        return self.scheme.format

    @property
    def fp8_scheme(self) -> Scheme:
        """How every FP8 linear is scaled: "tensor", "channel" or "block" (fp8route.schemes)."""
        return self.scheme.fp8_scheme


def load_checkpoint(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    fuse: bool = True,
    *,
    policy: Policy | None = None,
    preference: Preference | None = None,
    slices: Slices | None = None,
) -> Checkpoint:
    """Read a ModelOpt, compressed-tensors or quant_method "fp8" checkpoint (config.json + *.safetensors),
    scaled per tensor, per channel or in 128x128 blocks: a folder, or a Hugging Face repository id in the
    local hub cache (fp8route.checkpoint.hub.resolve_model_path). config.json and its quantization
    config are checked against the tensors' header shapes before any tensor data is read.

    device defaults to CUDA when available. Shards are read one at a time and each tensor goes
    to the device as it is read, so host memory peaks near one shard, not the model. With fuse,
    q/k/v and gate/up projections become one Fp8Linear each (per-tensor shards requantized to the
    largest weight scale, layer.requant_error says what that cost; channel and block scales
    concatenated, block members only when no block straddles two). On a GPU every layer is
    planned by this device's routing table (fp8route.load_table) unless a preference is given.

    slices (a tensor-parallel rank's, fp8route.models.parallel.Slicer) names the part of each
    weight to read: the layers are built, fused and planned from those parts alone. Per-tensor
    scales are read whole, so every rank fuses to the same scales; channel and block scales are
    read for the rank's part (fp8route.checkpoint.sharding, which refuses a split that cuts a block).
    """
    folder = resolve_model_path(path)
    config = read_json(folder / CONFIG)
    scheme = detect_scheme(folder, config)
    shards = ShardSet.open(folder)
    lay = layout(shards, scheme, fuse)
    dims = check_config(config, shards.tensors)
    if slices is not None:
        slices = ScaleSlices(slices, lay)
    target = default_device(device)
    policy = policy or Policy.from_env()
    if preference is None and target.type == "cuda":
        from fp8route.routing.store import load_table

        preference = load_table(target)
    loader = _Loader(shards, lay, target, policy, preference)
    for file, names in shards.by_file().items():
        for name, tensor in shards.read(file, names, slices):
            loader.take(shards.tensors[name], tensor)
    unfinished = sorted(set(loader.waiting) - set(loader.linears))
    assert not unfinished, f"layers never completed: {unfinished}"
    linears = {name: loader.linears[name] for name in sorted(loader.linears, key=natural_key)}
    return Checkpoint(
        folder, scheme, config, linears, loader.tensors, loader.kv_scales, lay.excluded, dict(lay.fused), dims
    )


def is_quantized(folder: Path, config: dict[str, object]) -> bool:
    """Whether the folder says it is a quantized checkpoint (load_checkpoint then checks how)."""
    return "quantization_config" in config or (folder / modelopt.HF_QUANT_CONFIG).is_file()


def read_plain(
    folder: Path, device: torch.device, dtype: torch.dtype | None, slices: Slices | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of an unquantized checkpoint on device, floats in dtype (None: as stored), one
    shard at a time; only the part slices names of a tensor it has an index for. config.json is
    checked against the tensors' header shapes first."""
    shards = ShardSet.open(folder)
    check_config(read_json(folder / CONFIG), shards.tensors)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in shards.by_file().items():
        for name, tensor in shards.read(file, names, slices):
            if tensor.dtype in _FP8:
                raise CheckpointError(
                    f"{name} in {file} is {tensor.dtype} but {folder} has no quantization config "
                    f"(quantization_config in {CONFIG} or {modelopt.HF_QUANT_CONFIG}); its scales cannot be found"
                )
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            tensors[name] = tensor.to(device, cast)
    return tensors


class _Loader:
    """Collects each linear's tensors as the shards go by and builds the layer once all are in."""

    def __init__(
        self, shards: ShardSet, lay: Layout, device: torch.device, policy: Policy | None, preference: Preference | None
    ) -> None:
        self.lay, self.device = lay, device
        self.kwargs: dict[str, Any] = {"policy": policy, "preference": preference}
        self.owner = lay.owner()
        self.kv_names = {info.name: canonical for canonical, info in lay.kv_scales.items()}
        self.waiting: dict[str, set[str]] = {}
        for tensor, group in self.owner.items():
            self.waiting.setdefault(group, set()).add(tensor)
        self.values: dict[str, torch.Tensor] = {}
        self.linears: dict[str, Fp8Linear] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.kv_scales: dict[str, torch.Tensor] = {}

    def take(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        if info.name in self.kv_names:
            self.kv_scales[self.kv_names[info.name]] = _scale(info, tensor, self.device)
            return
        group = self.owner.get(info.name)
        if group is None:
            self.tensors[info.name] = tensor.to(self.device)
            return
        self.values[info.name] = _checked(info, tensor.to(self.device), self.lay.scheme.fp8_scheme)
        waiting = self.waiting[group]
        waiting.discard(info.name)
        if not waiting:
            self.linears[group] = self._build(group)

    def _build(self, group: str) -> Fp8Linear:
        members = self.lay.fused.get(group, (group,))
        records = [self.lay.linears[m] for m in members]
        values = [{leaf: self.values.pop(info.name) for leaf, info in rec.parts.items()} for rec in records]
        scheme = self.lay.scheme
        kwargs = {**self.kwargs, "scheme": scheme.fp8_scheme, "name": group}
        scale = scheme.scale_name
        if len(records) == 1:
            v = values[0]
            return Fp8Linear(v["weight"], v[scale], v.get("input_scale"), v.get("bias"), **kwargs)
        return Fp8Linear.from_quantized(
            torch.cat([v["weight"] for v in values]),
            [v[scale] for v in values],
            [v["input_scale"] for v in values] if scheme.static_input else None,
            _fused_bias(values),
            logical_widths=[v["weight"].shape[0] for v in values],
            **kwargs,
        )


def _scale(info: TensorInfo, tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    try:
        return as_scale(info.where, tensor, device)
    except (Fp8InputError, Fp8TypeError) as e:
        raise CheckpointError(str(e)) from None


def _scales(info: TensorInfo, tensor: torch.Tensor) -> torch.Tensor:
    """A channel or block weight scale's values (the headers checked its shape), in fp32: [N] or [N, 1],
    or [N/128, K/128] (ModelOpt's [N/128, 1, K/128, 1] made 2-D)."""
    scales = tensor.float()
    if scales.dim() == 4:
        scales = scales[:, 0, :, 0]
    bad = int((~torch.isfinite(scales) | (scales <= 0)).sum())
    if bad:
        raise CheckpointError(f"{info.where}: {bad} scale(s) not finite and > 0; every scale must be finite and > 0")
    return scales.contiguous()


def _checked(info: TensorInfo, tensor: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Value checks a header cannot make; the tensor is already on its device."""
    leaf = info.name.rpartition(".")[2]
    if leaf == "input_scale" or (leaf in SCALE_NAMES and scheme == "tensor"):
        return _scale(info, tensor)
    if leaf in SCALE_NAMES:
        return _scales(info, tensor)
    if leaf.endswith("zero_point"):
        if tensor.float().abs().max().item() != 0:
            raise CheckpointError(
                f"unsupported: {info.where} is {tensor.float().flatten()[0].item()}; symmetric FP8 has zero points of 0"
            )
        return tensor
    try:
        if leaf == "weight":
            check_fp8_finite(info.where, tensor)
        elif leaf == "bias":
            check_finite(info.where, tensor)
    except Fp8InputError as e:
        raise CheckpointError(f"{e} (corrupt shard?)") from None
    return tensor


def _fused_bias(values: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    biases = [v.get("bias") for v in values]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    rows = [v["weight"].shape[0] for v in values]
    return torch.cat([b if b is not None else present[0].new_zeros(n) for b, n in zip(biases, rows, strict=True)])
