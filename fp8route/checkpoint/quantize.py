"""Make an FP8 checkpoint from a bf16/fp16 one, in one of the three schemes (fp8route.schemes) and a
format that writes it (formats.DEFAULT_FORMAT, formats.NOT_WRITTEN):

- tensor (static per-tensor; ModelOpt or compressed-tensors): calibration runs the float model one
  decoder layer at a time, only that layer's weights and the calibration activations in memory.
  Each linear's input is observed (observer.py) and its input scale chosen by an estimator
  (estimators.py: max, percentile or mse); its weight scale is amax(|weight|) / 448. Once every
  layer is calibrated, the layers are read again and written, so the linears whose FP8 error is
  largest can be kept in bf16 (keep_float, or as few as a KL budget needs: sensitivity.py)
  whatever their depth.
- channel (compressed-tensors FP8_DYNAMIC or ModelOpt FP8_PER_CHANNEL_PER_TOKEN) and block
  (quant_method fp8, or compressed-tensors FP8_BLOCK): amax / 448 per row or per 128x128 block
  (dynamic_weights.py); their inputs are quantized at run time, so there are no input scales to
  calibrate and the options that calibrate them are refused. Calibration data is read only for
  FP8 KV-cache scales (kv_cache="fp8"), which are the attention cache's and any scheme may have.

The choices are recorded in config.json's quantization_config under "fp8route", a key the
formats' own readers ignore.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8route.checkpoint import estimators
from fp8route.checkpoint.calibration import calibration_ids
from fp8route.checkpoint.config_check import check_config
from fp8route.checkpoint.destination import check_destination, write_folder
from fp8route.checkpoint.dynamic_weights import dynamic_linear
from fp8route.checkpoint.formats import (
    CONFIG,
    QuantScheme,
    compressed_tensors,
    fp8,
    modelopt,
    read_json,
    written_format,
)
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.checkpoint.kv_calibration import KV_CACHE, KvObserver
from fp8route.checkpoint.observer import SAMPLE_ROWS, InputObserver, ScaleChoice, observe
from fp8route.checkpoint.sensitivity import KlSearch, TrialModel, check_budget, search_budget
from fp8route.checkpoint.shards import INDEX, ShardSet, ShardWriter, check_shard_bytes
from fp8route.device import default_device
from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.models.llama import DecoderLayer, FloatLinear, LlamaConfig, Parts, RMSNorm, rope_tables
from fp8route.progress import Progress
from fp8route.quant import check_finite, quantize_per_tensor
from fp8route.schemes import Scheme, check_scheme
from fp8route.version import __version__

_EMBED = "model.embed_tokens.weight"
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
RECORD = "fp8route"  # the key of quantization_config that holds the calibration record
SENSITIVITY_MEASURE = (
    "relative output error ||q(x) @ Wq^T - x @ W^T||^2 / ||x @ W^T||^2 of each linear alone, "
    f"on a uniform subsample of up to {SAMPLE_ROWS} of its calibration input rows"
)


@dataclass
class QuantizeReport:
    dst: Path
    format: str
    scheme: Scheme = "tensor"
    quantized: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    input_amax: dict[str, float] = field(default_factory=dict)
    choices: dict[str, ScaleChoice] = field(default_factory=dict)
    kept_float: list[str] = field(default_factory=list)
    kv_scales: dict[str, float] = field(default_factory=dict)  # --kv-cache fp8: tensor name -> scale
    kl_search: KlSearch | None = None  # the --kl-budget pass, when one ran
    shards: list[str] = field(default_factory=list)
    calibration_tokens: int = 0
    record: dict[str, Any] = field(default_factory=dict)  # what config.json's quantization_config.fp8route holds
    seconds: float = 0.0


@dataclass(frozen=True)
class _Settings:
    format: str
    scheme: Scheme
    exclude: tuple[str, ...]
    estimator: str
    percentile: float
    keep_float: int
    source: str
    kl_budget: float | None = None
    kv_cache: str | None = None


def quantize_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str | None = None,
    calib: str | os.PathLike[str] | Sequence[torch.Tensor] | Sequence[str] | None = None,
    exclude: Sequence[str] = ("lm_head",),
    device: str | torch.device | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: Progress | None = None,
    *,
    calib_text: str | os.PathLike[str] | None = None,
    calib_seq_len: int = 512,
    calib_tokens: int = 16384,
    input_scale: str = "max",
    percentile: float = estimators.DEFAULT_PERCENTILE,
    keep_float: int = 0,
    kl_budget: float | None = None,
    kv_cache: str | None = None,
    scheme: str = "tensor",
) -> QuantizeReport:
    """Quantize every linear of a Llama-family checkpoint except those matching `exclude`
    (fnmatch wildcards or names; lm_head by default) in scheme ("tensor", "channel" or "block")
    and write a folder both fp8route and the format's own readers accept. format: "modelopt",
    "compressed-tensors" or "fp8"; None, the scheme's usual one (tensor: modelopt, channel:
    compressed-tensors FP8_DYNAMIC, block: quant_method fp8 as DeepSeek-V3 and Qwen3 write it).

    Calibration data: `calib` is a token-id file (a path: .json, .txt, .safetensors), token-id
    tensors, or texts (a list of str, tokenized with src's tokenizer.json); `calib_text` a UTF-8
    text file (documents separated by blank lines). Texts are packed into sequences of at most
    calib_seq_len tokens, calib_tokens in all. Nothing given: random token ids.
    input_scale: "max", "percentile" (of |x|, `percentile` in [90, 100]) or "mse".
    keep_float: leave the N quantizable linears with the largest relative output error in bf16
    (listed in the exclusions). kl_budget (instead): keep the fewest of them, in the same order,
    for which the model's mean KL(bf16 || fp8) on the calibration batch is <= kl_budget nats.
    kv_cache="fp8": also write per-layer FP8 KV-cache scales, amax / 448 of the rotated key and of
    the value on the calibration tokens (fp8route.checkpoint.kv_calibration).
    The channel and block schemes quantize every input at run time: input_scale, percentile,
    keep_float and kl_budget are refused with them, and calibration data without kv_cache too.
    """
    start = time.perf_counter()
    scheme = check_scheme(scheme)
    format = written_format(format, scheme)
    _check_arguments(format, input_scale, percentile, keep_float, kl_budget, kv_cache, max_shard_bytes)
    if scheme != "tensor":
        calibrates = calib is not None or calib_text is not None
        _check_dynamic(scheme, input_scale, percentile, keep_float, kl_budget, calibrates and kv_cache is None)
    src, dst = resolve_model_path(src), Path(dst)
    config, cfg, shards = _read_source(src)
    quantizable = _quantizable(shards, QuantScheme(format, "--exclude", tuple(exclude)))
    if keep_float > len(quantizable):
        raise Fp8InputError(f"keep_float={keep_float} but only {len(quantizable)} linears would be quantized")
    check_destination(dst, src, _output_bytes(src, shards, quantizable))
    target = default_device(device)
    sequences: list[torch.Tensor] = []
    source = "none"
    if scheme == "tensor" or kv_cache is not None:
        sequences, source = calibration_ids(src, cfg.vocab_size, calib, calib_text, calib_seq_len, calib_tokens)
    budget = None if kl_budget is None else float(kl_budget)
    settings = _Settings(
        format, scheme, tuple(exclude), input_scale, float(percentile), keep_float, source, budget, kv_cache
    )
    report = write_folder(
        dst,
        lambda folder: _quantize_into(
            folder, src, config, cfg, shards, sequences, settings, target, max_shard_bytes, progress
        ),
    )
    report.dst = dst
    report.seconds = time.perf_counter() - start
    return report


def _check_arguments(
    format: str,
    input_scale: str,
    percentile: float,
    keep_float: int,
    kl_budget: float | None,
    kv_cache: str | None,
    max_shard_bytes: int,
) -> None:
    """quantize_checkpoint's settings, each refused in one line before anything is read."""
    estimators.check_estimator(input_scale, percentile)
    if not isinstance(keep_float, int) or keep_float < 0:
        raise Fp8InputError(f"keep_float must be a non-negative number of linears, got {keep_float!r}")
    check_budget(kl_budget)
    if kv_cache is not None and kv_cache not in KV_CACHE:
        raise Fp8InputError(f"kv_cache must be one of {', '.join(KV_CACHE)} (or None), got {kv_cache!r}")
    check_shard_bytes(max_shard_bytes)
    if kl_budget is not None and keep_float:
        raise Fp8InputError("give keep_float (a count) or kl_budget (a KL), not both")


def _check_dynamic(
    scheme: Scheme, input_scale: str, percentile: float, keep_float: int, kl_budget: float | None, calib_data: bool
) -> None:
    """A dynamic scheme has no input scales: the options that calibrate them mean nothing for it."""
    defaults = (
        ("input_scale", input_scale, "max"),
        ("percentile", percentile, estimators.DEFAULT_PERCENTILE),
        ("keep_float", keep_float, 0),
        ("kl_budget", kl_budget, None),
    )
    given = [f"{name} (--{name.replace('_', '-')})" for name, value, default in defaults if value != default]
    if given:
        raise Fp8InputError(
            f"{', '.join(given)}: the {scheme} scheme quantizes each input at run time, so there are no input "
            "scales to calibrate; drop the option, or quantize with scheme tensor (static input scales)"
        )
    if calib_data:
        raise Fp8InputError(
            f"calibration data (--calib / --calib-text) with the {scheme} scheme calibrates only FP8 KV-cache scales, "
            "and kv_cache (--kv-cache fp8) was not asked for; drop the data, or add --kv-cache fp8"
        )


def _read_source(src: Path) -> tuple[dict[str, Any], LlamaConfig, ShardSet]:
    """src's config.json, as a model config, and its shards, once it is known to be an unquantized
    float checkpoint whose config agrees with its tensors."""
    config = read_json(src / CONFIG)
    if config.get("quantization_config") or (src / modelopt.HF_QUANT_CONFIG).exists():
        raise CheckpointError(
            f"{src} is already quantized (it has a quantization config); quantize a bf16/fp16 checkpoint"
        )
    cfg = LlamaConfig.from_hf(config)
    shards = ShardSet.open(src)
    check_config(config, shards.tensors)
    for info in shards.tensors.values():
        if info.torch_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(
                f"{info.where}: expected bfloat16/float16/float32 weights to quantize, got {info.dtype_name}"
            )
    return config, cfg, shards


def _quantizable(shards: ShardSet, matcher: QuantScheme) -> list[str]:
    """The module names of the 2-D weights (the embedding aside) that the exclusions leave."""
    linears = [
        n.removesuffix(".weight")
        for n, info in shards.tensors.items()
        if n.endswith(".weight") and len(info.shape) == 2 and n != _EMBED
    ]
    return [n for n in linears if not matcher.excludes(n)]


def _quantize_into(
    folder: Path,
    src: Path,
    config: dict[str, Any],
    cfg: LlamaConfig,
    shards: ShardSet,
    sequences: list[torch.Tensor],
    settings: _Settings,
    target: torch.device,
    max_shard_bytes: int,
    progress: Progress | None,
) -> QuantizeReport:
    """Calibrate what the scheme calibrates, then write the folder: for the tensor scheme every
    layer's input scales, then the linears kept in float (the layers are read twice so that a linear
    can be kept in float whatever its depth); for the others the KV-cache scales alone, if asked for."""
    tokens = sum(int(s.numel()) for s in sequences)
    report = QuantizeReport(folder, settings.format, settings.scheme, calibration_tokens=tokens)
    writer = ShardWriter(folder, max_shard_bytes)
    matcher = QuantScheme(settings.format, "--exclude", settings.exclude)
    quantizer = _Quantizer(shards, matcher, writer, report, target)
    if settings.scheme == "tensor":
        _calibrate_inputs(quantizer, cfg, sequences, settings, progress)
    else:
        quantizer.linears.update(_quantizable(shards, QuantScheme(settings.format, "every linear", ())))
        if settings.kv_cache is not None:
            _calibrate_layers(quantizer, cfg, sequences, None, True, progress)
    _write_tensors(quantizer, cfg)
    report.shards = writer.close()
    report.record = _record(report, settings, len(sequences))
    _write_configs(src, folder, config, settings, report.excluded, report.record)
    if progress:
        progress(cfg.num_hidden_layers + 1, cfg.num_hidden_layers + 1, "written")
    return report


def _calibrate_inputs(
    quantizer: _Quantizer,
    cfg: LlamaConfig,
    sequences: list[torch.Tensor],
    settings: _Settings,
    progress: Progress | None,
) -> None:
    """The tensor scheme's calibration: every linear's input scale (and, with kv_cache, the KV-cache
    scales), then the linears kept in float."""
    tokens = quantizer.report.calibration_tokens

    def make() -> InputObserver:
        return InputObserver(settings.estimator, settings.percentile, tokens)

    hidden = _calibrate_layers(quantizer, cfg, sequences, make, settings.kv_cache is not None, progress)
    _calibrate_lm_head(quantizer, cfg, hidden, make)
    _choose_kept_float(quantizer, cfg, sequences, hidden, settings, progress)


def _calibrate_layers(
    quantizer: _Quantizer,
    cfg: LlamaConfig,
    sequences: list[torch.Tensor],
    make: Callable[[], InputObserver] | None,
    kv_cache: bool,
    progress: Progress | None,
) -> list[torch.Tensor]:
    """Run the float model over the calibration sequences one decoder layer at a time (only that
    layer's weights in memory), choosing each observed linear's input scale (none without make) and,
    with kv_cache, each layer's KV-cache scales; the hidden states after the last layer."""
    report, shards, target = quantizer.report, quantizer.shards, quantizer.device
    embed = quantizer.load([_EMBED])[_EMBED]
    hidden = [embed[s.to(target)].float()[None] for s in sequences]
    del embed
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}"
        tensors = quantizer.load(_layer_names(shards, prefix))
        layer = DecoderLayer(cfg, Parts({}, tensors), prefix)
        observers = {} if make is None else observe(layer, prefix, make, quantizer.wanted)
        quantizer.linears.update(f"{prefix}.{n}" for n, m in layer.named_modules() if isinstance(m, FloatLinear))
        kv = KvObserver() if kv_cache else None
        with torch.no_grad():
            hidden = [layer(h, *rope_tables(cfg, torch.arange(h.shape[1], device=target)), kv) for h in hidden]
        if kv is not None:
            report.kv_scales.update(kv.scales(f"{prefix}.self_attn", report.format))
        for name, o in observers.items():
            report.choices[name] = o.choose(tensors[f"{name}.weight"], shards.tensors[f"{name}.weight"].where)
        del layer, tensors, observers
        if progress:
            progress(i + 1, cfg.num_hidden_layers + 1, f"layer {i + 1}/{cfg.num_hidden_layers}")
    return hidden


def _calibrate_lm_head(
    quantizer: _Quantizer, cfg: LlamaConfig, hidden: list[torch.Tensor], make: Callable[[], InputObserver]
) -> None:
    """lm_head's input scale, observed on the final norm of hidden (a tied lm_head has none)."""
    if "lm_head.weight" not in quantizer.shards.tensors:
        return
    quantizer.linears.add("lm_head")
    if not quantizer.wanted("lm_head"):
        return
    rest = quantizer.load(["model.norm.weight", "lm_head.weight"])
    observer = make()
    norm = RMSNorm(rest["model.norm.weight"], cfg.rms_norm_eps)
    for h in hidden:
        observer.update(norm(h))
    where = quantizer.shards.tensors["lm_head.weight"].where
    quantizer.report.choices["lm_head"] = observer.choose(rest["lm_head.weight"], where)


def _choose_kept_float(
    quantizer: _Quantizer,
    cfg: LlamaConfig,
    sequences: list[torch.Tensor],
    hidden: list[torch.Tensor],
    settings: _Settings,
    progress: Progress | None,
) -> None:
    """report.kept_float: the keep_float linears of largest relative error or, with a KL budget,
    the fewest of them in that order for which the model's KL stays within it."""
    report, shards = quantizer.report, quantizer.shards
    if settings.keep_float > len(report.choices):
        raise Fp8InputError(f"keep_float={settings.keep_float} but only {len(report.choices)} linears are quantized")
    ranked = sorted(report.choices, key=lambda n: report.choices[n].rel_error, reverse=True)
    report.kept_float = ranked[: settings.keep_float]
    if settings.kl_budget is None:
        return
    final = quantizer.load([n for n in ("model.norm.weight", "lm_head.weight") if n in shards.tensors])
    embed = quantizer.load([_EMBED])[_EMBED]
    trial = TrialModel(
        cfg,
        lambda i: quantizer.load(_layer_names(shards, f"model.layers.{i}")),
        embed,
        final,
        sequences,
        hidden,
        report.choices,
        quantizer.device,
    )
    report.kl_search = search_budget(ranked, settings.kl_budget, lambda k: trial.kl(set(ranked[:k])), progress)
    report.kept_float = report.kl_search.kept


def _write_tensors(quantizer: _Quantizer, cfg: LlamaConfig) -> None:
    """Every tensor of the source, layer by layer: the calibrated linears not kept in float in FP8,
    the rest as they are, then the KV-cache scales."""
    shards, report = quantizer.shards, quantizer.report
    quantizer.write_plain(quantizer.load([_EMBED]))
    for i in range(cfg.num_hidden_layers):
        quantizer.write_layer(quantizer.load(_layer_names(shards, f"model.layers.{i}")))
    quantizer.write_layer(quantizer.load([n for n in shards.tensors if n not in quantizer.written]))
    for name, scale in report.kv_scales.items():
        quantizer.write_scale(name, torch.tensor(scale, dtype=torch.float32))
    if "lm_head.weight" not in shards.tensors and "lm_head" not in report.excluded:
        report.excluded.append("lm_head")  # tied to the embedding: engines must not quantize it


def _output_bytes(src: Path, shards: ShardSet, quantizable: list[str]) -> int:
    """About what the folder will take: one byte per quantized weight, the rest as it is now."""
    fp8 = {f"{n}.weight" for n in quantizable}
    size = 0
    for name, info in shards.tensors.items():
        dtype = info.torch_dtype
        size += info.numel * (1 if name in fp8 or dtype is None else dtype.itemsize)
    copied = [p for p in src.iterdir() if p.is_file() and not p.name.endswith(_NOT_COPIED)]
    return size + sum(p.stat().st_size for p in copied)


def _layer_names(shards: ShardSet, prefix: str) -> list[str]:
    return [n for n in shards.tensors if n.startswith(prefix + ".")]


def _record(report: QuantizeReport, settings: _Settings, sequences: int) -> dict[str, Any]:
    """The calibration record written into config.json: enough to redo or judge the checkpoint."""
    record: dict[str, Any] = {"version": __version__, "scheme": settings.scheme}
    if settings.scheme == "tensor":
        record.update(_input_calibration(report, settings, sequences))
    elif report.calibration_tokens:
        record["calibration"] = {"tokens": report.calibration_tokens, "sequences": sequences, "source": settings.source}
    if report.kl_search is not None:
        record["kl_budget"] = report.kl_search.record(report.calibration_tokens)
    if report.kv_scales:
        record["kv_cache"] = {"dtype": settings.kv_cache, "scales": "amax / 448 of the rotated key and of the value"}
    return record


def _input_calibration(report: QuantizeReport, settings: _Settings, sequences: int) -> dict[str, Any]:
    """How the tensor scheme's input scales were chosen, and what their linears' FP8 error is."""
    calibration: dict[str, Any] = {
        "estimator": settings.estimator,
        "percentile": settings.percentile if settings.estimator == "percentile" else None,
        "tokens": report.calibration_tokens,
        "sequences": sequences,
        "source": settings.source,
    }
    if settings.estimator == "mse":
        calibration["mse_candidates"] = list(estimators.MSE_CANDIDATES)
    quantized = [report.choices[n] for n in report.quantized]
    clipped = sum(1 for c in quantized if c.clip_fraction < 1.0)
    calibration["clipped_linears"] = clipped  # linears whose input scale is below amax/448
    errors = sorted((c.rel_error for c in quantized), reverse=True)
    sensitivity: dict[str, Any] = {
        "measure": SENSITIVITY_MEASURE,
        "largest_quantized": errors[0] if errors else None,
        "median_quantized": errors[len(errors) // 2] if errors else None,
        "kept": {n: report.choices[n].rel_error for n in report.kept_float},
    }
    return {"calibration": calibration, "kept_float": list(report.kept_float), "sensitivity": sensitivity}


class _Quantizer:
    def __init__(
        self, shards: ShardSet, matcher: QuantScheme, writer: ShardWriter, report: QuantizeReport, device: torch.device
    ) -> None:
        self.shards, self.matcher, self.writer, self.report, self.device = shards, matcher, writer, report, device
        self.written: set[str] = set()
        self.linears: set[str] = set()  # every linear's module name, quantized or not

    def wanted(self, module: str) -> bool:
        """Whether module is to be calibrated and quantized (the exclusions do not name it)."""
        return not self.matcher.excludes(module)

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

    def write_layer(self, tensors: dict[str, torch.Tensor]) -> None:
        """Quantize the linears the scheme quantizes (tensor: those calibrated and not kept in float;
        the others: those the exclusions leave); write everything else as it is, listing the linears
        left in float as excluded."""
        for name in sorted(tensors):
            module, _, leaf = name.rpartition(".")
            t = tensors[name]
            if leaf == "weight" and module in self.linears and t.dim() == 2:
                if self.report.scheme != "tensor" and self.wanted(module):
                    self._write_dynamic(module, t)
                    continue
                choice = self.report.choices.get(module)
                if choice is None or module in self.report.kept_float:
                    self.report.excluded.append(module)
                else:
                    self._write_fp8(module, t, choice)
                    continue
            self.writer.add(name, t)
            self.written.add(name)

    def _write_fp8(self, module: str, weight: torch.Tensor, choice: ScaleChoice) -> None:
        qweight, scale = quantize_per_tensor(weight.float(), name=f"{module}.weight")
        self.writer.add(f"{module}.weight", qweight)
        self.write_scale(f"{module}.weight_scale", scale.float())
        self.write_scale(f"{module}.input_scale", torch.tensor(choice.scale, dtype=torch.float32))
        self.written.add(f"{module}.weight")
        self.report.quantized.append(module)
        self.report.input_amax[module] = choice.amax

    def _write_dynamic(self, module: str, weight: torch.Tensor) -> None:
        check_finite(self.shards.tensors[f"{module}.weight"].where, weight)
        for name, t in dynamic_linear(module, weight, self.report.scheme, self.report.format).items():
            self.writer.add(name, t)
        self.written.add(f"{module}.weight")
        self.report.quantized.append(module)

    def write_scale(self, name: str, scale: torch.Tensor) -> None:
        """A scalar scale, in the format's shape: ModelOpt writes them as [], compressed-tensors as [1]."""
        self.writer.add(name, scale.reshape((1,) if self.report.format == compressed_tensors.FORMAT else ()))


def _write_configs(
    src: Path, dst: Path, config: dict[str, Any], settings: _Settings, excluded: list[str], record: dict[str, Any]
) -> None:
    kv_cache = "kv_cache" in record  # KV-cache scales were written
    names = sorted(set(excluded))
    producer = {"name": "fp8route", "version": __version__}
    if settings.format == modelopt.FORMAT:
        qc, hf_quant = modelopt.config_files(names, producer, kv_cache, settings.scheme)
        (dst / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    elif settings.format == compressed_tensors.FORMAT:
        qc = compressed_tensors.quantization_config(names, kv_cache, settings.scheme)
    else:
        qc = fp8.quantization_config(names)  # the k/v_scale tensors alone say the KV cache has scales
    qc[RECORD] = record  # not a key any format defines: their readers (and ours) ignore it
    (dst / CONFIG).write_text(json.dumps({**config, "quantization_config": qc}, indent=2) + "\n")
    for path in src.iterdir():
        skip = path.name in (CONFIG, INDEX, modelopt.HF_QUANT_CONFIG) or path.name.endswith(_NOT_COPIED)
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)
