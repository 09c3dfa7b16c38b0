"""EngineConfig: every setting of the engine, defined once, checked once.

Each field carries its default and its help; `add_engine_args` makes a command line's flags from them
and `EngineConfig.from_args` reads them back, so `LLM`, `load_model`, `serve`, `bench serve`,
`bench e2e`, `generate` and `eval` share one name, one default and one check per setting (vLLM's
EngineArgs is the model). A bad value is one Fp8InputError naming the field, at construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8route.device import usable_cores
from fp8route.errors import Fp8InputError
from fp8route.models.collectives import METHODS
from fp8route.models.parallel import LM_HEADS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", "fp8")
ATTENTION = ("builtin", "flashinfer")
# A CPU's token budget when none is given: a step of 512 tokens of SmolLM2-135M takes about a second
# on two cores, so a long prompt's chunks hold every other stream up by that much (8192 held them ~14 s).
CPU_BATCHED_TOKENS = 512


def _setting(default: Any, help: str, choices: Sequence[str] | None = None, cli: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _setting(
        "", "a checkpoint folder, a repository id in the Hugging Face hub cache, or smollm2 (-channel, -block, -bf16)"
    )
    dtype: str = _setting("bfloat16", "activations, the KV cache and every unquantized tensor", tuple(DTYPES))
    device: str | None = _setting(None, "cuda or cpu (default: cuda when there is one)")
    max_model_len: int | None = _setting(None, "context length: prompt plus output (default: the model's)")
    max_num_seqs: int = _setting(256, "requests running at once: the decode batch at most")
    max_num_batched_tokens: int | None = _setting(
        None, f"tokens one step computes: every running decode plus the prefill chunks that fit "
        f"(default: 8192 on a GPU, {CPU_BATCHED_TOKENS} on a CPU, where a long chunk would stall every stream)",
    )  # fmt: skip
    gpu_memory_utilization: float = _setting(0.9, "the share of GPU memory the weights, activations and KV cache take")
    num_kv_blocks: int | None = _setting(
        None, "KV blocks, instead of sizing the pool (default: from GPU memory; 32768 tokens on a CPU)"
    )
    block_size: int = _setting(16, "tokens per KV block: the unit of prefix sharing (a power of two)")
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of prompt prefixes seen before")
    kv_cache_dtype: str = _setting(
        "auto", "auto: the cache in --dtype; fp8: float8_e4m3fn with the checkpoint's k/v scales", KV_CACHE_DTYPES
    )
    attention: str = _setting(
        "builtin", "builtin: fp8route's Triton kernels; flashinfer: FlashInfer's (the extra, CUDA)", ATTENTION
    )
    use_cuda_graphs: bool = _setting(True, "replay decode steps, and the pieces of a mixed step, from CUDA graphs")
    prefill_graphs: bool = _setting(True, "a mixed step's work between attentions from CUDA graphs")
    async_scheduling: bool | None = _setting(
        None, "prepare the next step while the GPU runs this one (default: on a GPU, unless attention is flashinfer)"
    )
    tp: int = _setting(1, "tensor parallel ranks, one GPU each (generate, bench e2e, eval)")
    all_reduce: str = _setting("nccl", "how tensor parallel ranks sum their partial outputs", METHODS)
    cpu_threads: int | None = _setting(
        None, "threads a CPU engine computes with (default: $OMP_NUM_THREADS if set, else the cores this process "
        "may use, less one for the host's scheduling and I/O, divided among tensor parallel ranks)",
    )  # fmt: skip
    tp_lm_head: str = _setting(
        "vocab", "lm_head under tensor parallelism: split over the vocabulary, or whole", LM_HEADS
    )
    skip_tokenizer_init: bool = _setting(False, "token ids in and out: no tokenizer.json needed", cli=False)
    record_stats: bool = _setting(False, "keep each step's accounting (benchmarks)", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):  # LLM(..., dtype=torch.float32) reads as well as "float32"
            name = next((n for n, d in DTYPES.items() if d == self.dtype), str(self.dtype))
            object.__setattr__(self, "dtype", name)
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                _fail(f.name, f"one of {', '.join(choices)}", getattr(self, f.name))
        for name in ("max_num_seqs", "block_size", "tp"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "cpu_threads"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            _fail("num_kv_blocks", "at least 2 (one is scratch)", self.num_kv_blocks)
        if self.block_size & (self.block_size - 1):
            _fail("block_size", "a power of two", self.block_size)
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or math.isnan(utilization) or not 0 < utilization <= 1:
            _fail("gpu_memory_utilization", "in (0, 1]", utilization)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise Fp8InputError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running request takes a token of each step's budget"
            )
        if self.async_scheduling and self.attention == "flashinfer":
            raise Fp8InputError(
                "async_scheduling does not run with attention='flashinfer' (FlashInfer plans each decode step "
                "through a host buffer the next step's plan would overwrite before the GPU has read it): use the "
                "builtin attention with it"
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError:
                _fail("device", "cuda, cuda:N or cpu", self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def batched_tokens(self, device: torch.device) -> int:
        """max_num_batched_tokens, or the default for this device."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(8192 if device.type == "cuda" else CPU_BATCHED_TOKENS, self.max_num_seqs)

    def threads(self) -> int | None:
        """The CPU engine's thread count: cpu_threads, or None where OMP_NUM_THREADS already says it,
        or the cores sched_getaffinity allows this process, one left for the host thread that
        schedules, tokenizes and serves (vLLM's CPU backend reserves one too), shared among the
        tensor parallel ranks on this machine. torch's own default is every core, which
        oversubscribes them as soon as anything else runs (decode fell 23 -> 1.6 tok/s on 2 cores
        beside one busy process)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
        return max(1, (usable_cores() - 1) // ranks)

    def use_cpu_threads(self) -> None:
        """Set torch's CPU thread count to threads() (where that is not left to OMP_NUM_THREADS)."""
        threads = self.threads()
        if threads is not None:
            torch.set_num_threads(threads)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config a command line's flags (add_engine_args) ask for; overrides win. A bad value's
        message names the flag."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        try:
            return cls(**{**values, **overrides})
        except Fp8InputError as exc:
            text = str(exc)
            name = next((f.name for f in dataclasses.fields(cls) if text.startswith(f.name + " ")), None)
            if name is None:
                raise
            raise Fp8InputError("--" + name.replace("_", "-") + text[len(name) :]) from None


def _fail(name: str, wanted: str, got: object) -> None:
    raise Fp8InputError(f"{name} must be {wanted}, got {got!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(name, "an integer >= 1", value)


def add_engine_args(parser: argparse.ArgumentParser, names: Sequence[str], **defaults: Any) -> None:
    """Flags for these EngineConfig fields, each with its help and default (defaults: a command's own,
    shown as such). `model` is the positional argument."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in names:
        f = fields[name]
        default = defaults.get(name, f.default)
        meta = f.metadata
        help_text = f"{meta['help']} (default: {default})" if default not in (None, "") else meta["help"]
        if name == "model":
            parser.add_argument("model", help=meta["help"])
            continue
        flag = "--" + name.replace("_", "-")
        kind = _kind(f)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:  # choices are EngineConfig's to check: one line naming the flag, not argparse's usage
            choices = meta["choices"]
            metavar = "{" + ",".join(choices) + "}" if choices else None
            parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=help_text)


def _kind(f: dataclasses.Field) -> type:
    text = str(f.type)
    for kind in (bool, int, float):
        if kind.__name__ in text:
            return kind
    return str


__all__ = ["ATTENTION", "DTYPES", "KV_CACHE_DTYPES", "EngineConfig", "add_engine_args"]
