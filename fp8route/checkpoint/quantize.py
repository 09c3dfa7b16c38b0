"""Make a static per-tensor FP8 checkpoint (ModelOpt or compressed-tensors) from a bf16/fp16 one.

Calibration runs the float model one decoder layer at a time: only that layer's weights and
the calibration activations are in memory, and each layer is quantized and written as soon as
its inputs have been seen. A linear's input scale is amax(|input|) / 448 over the calibration
tokens; its weight scale is amax(|weight|) / 448.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8route.backends.problem import default_device
from fp8route.checkpoint.calibration import generated_token_ids, load_token_ids
from fp8route.checkpoint.formats import CONFIG, FORMATS, QuantScheme, compressed_tensors, modelopt, read_json
from fp8route.checkpoint.shards import INDEX, ShardSet, ShardWriter
from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.models.llama import DecoderLayer, FloatLinear, LlamaConfig, Parts, RMSNorm, rope_tables
from fp8route.progress import Progress
from fp8route.quant import FP8_MAX, quantize_per_tensor
from fp8route.version import __version__

_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MIN_AMAX = 1e-6  # a linear whose input was all zeros still needs a positive scale


@dataclass
class QuantizeReport:
    dst: Path
    format: str
    quantized: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    input_amax: dict[str, float] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    calibration_tokens: int = 0
    seconds: float = 0.0


def quantize_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str = "modelopt",
    calib: str | os.PathLike[str] | Sequence[torch.Tensor] | None = None,
    exclude: Sequence[str] = ("lm_head",),
    device: str | torch.device | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: Progress | None = None,
) -> QuantizeReport:
    """Quantize every linear of a Llama-family checkpoint except those matching `exclude`
    (fnmatch wildcards or names; lm_head by default) and write a folder both fp8route and
    the format's own readers accept."""
    start = time.perf_counter()
    if format not in FORMATS:
        raise Fp8InputError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    src, dst = Path(src), Path(dst)
    config = read_json(src / CONFIG)
    if config.get("quantization_config") or (src / modelopt.HF_QUANT_CONFIG).exists():
        raise CheckpointError(
            f"{src} is already quantized (it has a quantization config); quantize a bf16/fp16 checkpoint"
        )
    cfg = LlamaConfig.from_hf(config)
    shards = ShardSet.open(src)
    for info in shards.tensors.values():
        if info.torch_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(
                f"{info.where}: expected bfloat16/float16/float32 weights to quantize, got {info.dtype_name}"
            )
    _check_destination(dst, src)
    target = default_device(device)
    if calib is None:
        sequences = generated_token_ids(cfg.vocab_size)
    elif isinstance(calib, (str, os.PathLike)):
        sequences = load_token_ids(calib, cfg.vocab_size)
    else:
        sequences = list(calib)
    # Written into a hidden folder beside dst and renamed at the end: a failure leaves nothing behind.
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        report = _quantize_into(
            staging, src, config, cfg, shards, sequences, format, exclude, target, max_shard_bytes, progress
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # empty, as _check_destination made sure
    staging.rename(dst)
    report.dst = dst
    report.seconds = time.perf_counter() - start
    return report


def _quantize_into(
    folder: Path,
    src: Path,
    config: dict[str, Any],
    cfg: LlamaConfig,
    shards: ShardSet,
    sequences: list[torch.Tensor],
    format: str,
    exclude: Sequence[str],
    target: torch.device,
    max_shard_bytes: int,
    progress: Progress | None,
) -> QuantizeReport:
    report = QuantizeReport(folder, format, calibration_tokens=sum(int(s.numel()) for s in sequences))
    matcher = QuantScheme(format, "--exclude", tuple(exclude))
    writer = ShardWriter(folder, max_shard_bytes)
    quantizer = _Quantizer(shards, matcher, writer, report, target)

    embed = quantizer.load(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    hidden = [embed[s.to(target)].float()[None] for s in sequences]
    quantizer.write_plain({"model.embed_tokens.weight": embed})
    total = cfg.num_hidden_layers + 1
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}"
        tensors = quantizer.load([n for n in shards.tensors if n.startswith(prefix + ".")])
        layer = DecoderLayer(cfg, Parts({}, tensors), prefix)
        amax = _observe(layer, prefix)
        with torch.no_grad():
            hidden = [layer(h, *rope_tables(cfg, torch.arange(h.shape[1], device=target))) for h in hidden]
        quantizer.write_layer(tensors, amax)
        del layer, tensors
        if progress:
            progress(i + 1, total, f"layer {i + 1}/{cfg.num_hidden_layers}")
    rest = quantizer.load([n for n in shards.tensors if n not in quantizer.written])
    amax = {}
    if "lm_head.weight" in rest:
        norm = RMSNorm(rest["model.norm.weight"], cfg.rms_norm_eps)
        amax["lm_head"] = max(norm(h).abs().max().item() for h in hidden)
    quantizer.write_layer(rest, amax)
    if "lm_head.weight" not in shards.tensors and "lm_head" not in report.excluded:
        report.excluded.append("lm_head")  # tied to the embedding: engines must not quantize it
    report.shards = writer.close()
    _write_configs(src, folder, config, format, report.excluded)
    if progress:
        progress(total, total, "written")
    return report


class _Quantizer:
    def __init__(
        self, shards: ShardSet, matcher: QuantScheme, writer: ShardWriter, report: QuantizeReport, device: torch.device
    ) -> None:
        self.shards, self.matcher, self.writer, self.report, self.device = shards, matcher, writer, report, device
        self.written: set[str] = set()

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        for file, in_file in self.shards.by_file().items():
            picked = [n for n in in_file if n in wanted]
            if picked:
                out.update((name, t.to(self.device)) for name, t in self.shards.read(file, picked))
        return out

    def write_plain(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.writer.add(name, t)
            self.written.add(name)

    def write_layer(self, tensors: dict[str, torch.Tensor], amax: dict[str, float]) -> None:
        """Quantize the observed linears that are not excluded; write everything else as it is."""
        for name in sorted(tensors):
            module, _, leaf = name.rpartition(".")
            t = tensors[name]
            if leaf == "weight" and module in amax and t.dim() == 2:
                if self.matcher.excludes(module):
                    self.report.excluded.append(module)
                else:
                    self._write_fp8(module, t, amax[module])
                    continue
            self.writer.add(name, t)
            self.written.add(name)

    def _write_fp8(self, module: str, weight: torch.Tensor, amax: float) -> None:
        qweight, scale = quantize_per_tensor(weight.float())
        input_scale = torch.tensor(max(amax, _MIN_AMAX) / FP8_MAX, dtype=torch.float32)
        # ModelOpt writes scalar scales as shape [], compressed-tensors as [1].
        shape = (1,) if self.report.format == compressed_tensors.FORMAT else ()
        self.writer.add(f"{module}.weight", qweight)
        self.writer.add(f"{module}.weight_scale", scale.float().reshape(shape))
        self.writer.add(f"{module}.input_scale", input_scale.reshape(shape))
        self.written.add(f"{module}.weight")
        self.report.quantized.append(module)
        self.report.input_amax[module] = amax


def _observe(layer: nn.Module, prefix: str) -> dict[str, float]:
    """amax of each linear's input, updated by forward pre-hooks as calibration runs (the hooks
    stay for the layer's lifetime, which ends with its calibration)."""
    amax: dict[str, float] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())

        return record

    for name, module in layer.named_modules():
        if isinstance(module, FloatLinear):
            module.register_forward_pre_hook(hook(f"{prefix}.{name}"))
    return amax


def _check_destination(dst: Path, src: Path) -> None:
    if dst.resolve() == src.resolve():
        raise Fp8InputError(f"destination {dst} is the source folder; choose a new folder")
    if dst.exists() and not dst.is_dir():
        raise Fp8InputError(f"destination {dst} is a file; choose a new folder")
    if dst.exists() and any(dst.iterdir()):
        raise Fp8InputError(f"destination {dst} exists and is not empty; choose a new or empty folder")


def _write_configs(src: Path, dst: Path, config: dict[str, Any], format: str, excluded: list[str]) -> None:
    names = sorted(set(excluded))
    producer = {"name": "fp8route", "version": __version__}
    if format == modelopt.FORMAT:
        qc, hf_quant = modelopt.config_files(names, producer)
        (dst / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    else:
        qc = compressed_tensors.quantization_config(names)
    (dst / CONFIG).write_text(json.dumps({**config, "quantization_config": qc}, indent=2) + "\n")
    for path in src.iterdir():
        skip = path.name in (CONFIG, INDEX, modelopt.HF_QUANT_CONFIG) or path.name.endswith(_NOT_COPIED)
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)
