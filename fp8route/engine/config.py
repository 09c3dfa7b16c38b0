"""EngineConfig: every setting of the engine, defined once, checked once.

Each field carries its default, its help, its choices and its check. `add_engine_args` makes every
command line's flag for a field from it (in the bench commands, a comma-separated list of values run
as arms, read back by `sweep_values`), and `EngineConfig.from_args` reads the flags back: `LLM`,
`load_model` and every command share one name, one default and one check per setting (vLLM's
EngineArgs is the model). A bad value is one Fp8InputError naming the field, or the flag it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8route.device import default_device, usable_cores
from fp8route.errors import Fp8InputError
from fp8route.kernels.options import set_kernel_options
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR
from fp8route.models.collectives import METHODS
from fp8route.models.parallel import LM_HEADS, LmHead

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", "fp8")
ATTENTION = ("builtin", "flashinfer")
ADMISSION = ("on_demand", "reserve")
# A CPU's token budget when none is given: a step of 512 tokens of SmolLM2-135M takes about a second
# on two cores, so a long prompt's chunks hold every other stream up by that much (8192 held them ~14 s).
CPU_BATCHED_TOKENS = 512

Check = Callable[[str, Any], None]  # (the name to show, the value): Fp8InputError when the value is bad


def _fail(name: str, wanted: str, got: object) -> None:
    raise Fp8InputError(f"{name} must be {wanted}, got {got!r}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(name, "an integer >= 1", value)


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None:
        _positive(name, value)


def _block_count(name: str, value: Any) -> None:
    _positive_or_none(name, value)
    if value is not None and value < 2:
        _fail(name, "at least 2 (one is scratch)", value)


def _power_of_two(name: str, value: Any) -> None:
    _positive(name, value)
    if value & (value - 1):
        _fail(name, "a power of two", value)


def _share(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or not 0 < value <= 1:
        _fail(name, "in (0, 1]", value)


def _milliseconds_or_none(name: str, value: Any) -> None:
    if value is not None and (
        not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value <= 0
    ):
        _fail(name, "a number of milliseconds > 0", value)


def _device(name: str, value: Any) -> None:
    if value is None:
        return
    try:
        torch.device(value)
    except RuntimeError:
        _fail(name, "cuda, cuda:N or cpu", value)


def _setting(
    default: Any, help: str, choices: Sequence[str] | None = None, check: Check | None = None, cli: bool = True
) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "check": check, "cli": cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _setting(
        "", "a checkpoint folder, a repository id in the Hugging Face hub cache, or smollm2 (-channel, -block, -bf16)"
    )
    dtype: str = _setting("bfloat16", "activations, the KV cache and every unquantized tensor", tuple(DTYPES))
    device: str | None = _setting(None, "cuda or cpu (default: cuda when there is one)", check=_device)
    max_model_len: int | None = _setting(
        None, "context length: prompt plus output (default: the model's)", check=_positive_or_none
    )
    max_num_seqs: int = _setting(256, "requests running at once: the decode batch at most", check=_positive)
    max_num_batched_tokens: int | None = _setting(
        None, f"tokens one step computes: every running decode plus the prefill chunks that fit "
        f"(default: 8192 on a GPU, {CPU_BATCHED_TOKENS} on a CPU, where a long chunk would stall every stream)",
        check=_positive_or_none,
    )  # fmt: skip
    itl_target_ms: float | None = _setting(
        None, "keep each step within this many ms: its prefill chunks sized from a cost model of a step "
        "measured at start (default: the token budget alone)",
        check=_milliseconds_or_none,
    )  # fmt: skip
    admission: str = _setting(
        "on_demand", "on_demand: admit a request while the KV pool has room for it now, and preempt the newest "
        "(computed again later) when the pool runs out; reserve: admit one only while the pool holds every running "
        "request to its max_tokens (the context, where not given), so none is ever preempted",
        ADMISSION,
    )  # fmt: skip
    gpu_memory_utilization: float = _setting(
        0.9, "the share of GPU memory the weights, activations and KV cache take", check=_share
    )
    num_kv_blocks: int | None = _setting(
        None, "KV blocks, instead of sizing the pool (default: from GPU memory; 32768 tokens on a CPU)",
        check=_block_count,
    )  # fmt: skip
    block_size: int = _setting(
        16, "tokens per KV block: the unit of prefix sharing (a power of two)", check=_power_of_two
    )
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
    tp: int = _setting(1, "tensor parallel ranks, one GPU each (generate, bench e2e, eval)", check=_positive)
    all_reduce: str = _setting("nccl", "how tensor parallel ranks sum their partial outputs", METHODS)
    cpu_threads: int | None = _setting(
        None, "threads a CPU engine computes with (default: $OMP_NUM_THREADS if set, else the cores this process "
        "may use, less one for the host's scheduling and I/O, divided among tensor parallel ranks)",
        check=_positive_or_none,
    )  # fmt: skip
    tp_lm_head: LmHead = _setting(
        "vocab", "lm_head under tensor parallelism: split over the vocabulary, or whole", LM_HEADS
    )
    # The kernel options stay process globals that the kernels read at launch (fp8route.kernels.options):
    # load_model sets them from these, and None leaves them as fp8route.set_kernel_options set them.
    pdl: bool | None = _setting(
        None, "launch fp8route's own kernels with programmatic dependent launch, Hopper on (default: each "
        "decode graph captured with and without it and the faster kept; elsewhere as set_kernel_options left it, off)",
    )  # fmt: skip
    quantize_upstream: bool | None = _setting(
        None, "x quantized by the norm or SiLU-up kernel before a layer whose backend reads it quantized "
        "(default: as set_kernel_options left it, on)",
    )  # fmt: skip
    deterministic: bool = _setting(
        False, "a request's tokens and logprobs do not depend on what shares its batch or how its prompt is "
        "chunked or cached: batch-invariant GEMMs and attention, at a cost (docs/engine.md)"
    )  # fmt: skip
    skip_tokenizer_init: bool = _setting(False, "token ids in and out: no tokenizer.json needed", cli=False)
    record_stats: bool = _setting(False, "keep each step's accounting (benchmarks)", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):  # LLM(..., dtype=torch.float32) reads as well as "float32"
            name = next((n for n, d in DTYPES.items() if d == self.dtype), str(self.dtype))
            object.__setattr__(self, "dtype", name)
        for f in dataclasses.fields(self):
            check_setting(f.name, getattr(self, f.name))
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

    def check_deterministic(self) -> None:
        """Refuse, before any weight is read, a deterministic engine this build cannot keep so."""
        if self.tp > 1:
            raise Fp8InputError(
                f"deterministic=True runs on one rank (tp={self.tp}): the ranks' sum is not batch-invariant yet"
            )
        if default_device(self.device).type != "cuda":
            return
        if self.dtype == "float32":
            raise Fp8InputError(
                "deterministic=True on a GPU runs bfloat16 or float16 activations (its fixed-tile GEMM has no "
                "fp32 form): pass dtype bfloat16, or device cpu for float32"
            )
        if self.attention == "flashinfer":
            raise Fp8InputError(
                "deterministic=True runs fp8route's own attention (FlashInfer's splits a row's positions by "
                "the batch): leave attention at builtin"
            )
        if TRITON_IMPORT_ERROR is not None:
            raise Fp8InputError(
                f"deterministic=True on a GPU runs fp8route's Triton GEMM and attention, and {TRITON_IMPORT_ERROR}: "
                "pip install 'fp8route[triton]'"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def batched_tokens(self, device: torch.device) -> int:
        """max_num_batched_tokens, or the default for this device."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(8192 if device.type == "cuda" else CPU_BATCHED_TOKENS, self.max_num_seqs)

    def resolved(self, device: torch.device, context: int) -> EngineConfig:
        """This config with what it leaves to the model and the device filled in, as the engine's
        parts read it: device, max_model_len (the model's context, which it may not exceed),
        max_num_batched_tokens (the device's default) and async_scheduling (on a GPU unless attention
        is flashinfer)."""
        if self.max_model_len is not None and self.max_model_len > context:
            raise Fp8InputError(f"max_model_len={self.max_model_len} exceeds the model's context of {context} tokens")
        return self.replace(
            device=str(device), max_model_len=self.max_model_len or context,
            max_num_batched_tokens=self.batched_tokens(device),
            async_scheduling=self.async_scheduling if self.async_scheduling is not None
            else device.type == "cuda" and self.attention != "flashinfer",
        )  # fmt: skip

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

    def apply_kernel_options(self) -> None:
        """Set the process's kernel options to pdl and quantize_upstream where given (None keeps one as
        it is); Fp8InputError where PDL cannot run on the current CUDA device."""
        set_kernel_options(pdl=self.pdl, quantize_upstream=self.quantize_upstream)

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
            raise Fp8InputError(_flag(name) + text[len(name) :]) from None


FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def check_setting(name: str, value: object, label: str | None = None) -> None:
    """The one check of one setting's value, wherever the value comes from (an EngineConfig, one arm of
    a bench flag, a function that takes the setting alone): Fp8InputError "LABEL must be ..., got ...",
    LABEL the setting's name unless given (a flag)."""
    meta = FIELDS[name].metadata
    choices, check = meta["choices"], meta["check"]
    if choices and value not in choices:
        _fail(label or name, f"one of {', '.join(choices)}", value)
    if check is not None:
        check(label or name, value)


# -- the command line ---------------------------------------------------------------------------------


_FIELDS_OWN: Any = object()  # a Flag's default where the command keeps the field's


@dataclass(frozen=True)
class Flag:
    """How one command shows a field where its command line differs from the field's own; the field
    still gives the flag's name, type and check."""

    default: Any = _FIELDS_OWN  # the command's own default, shown as such
    help: str | None = None  # the command's words for what the setting does there
    spelling: str | None = None  # the flag's name where users already have another (dest: the field)
    choices: Sequence[str] | None = None  # the values this command takes, where it checks them itself
    optional: bool = False  # the positional MODEL may be left out (for --random, --url)


_SWITCH = {"on": True, "off": False}
_KIND_NAMES = {int: "integers", float: "numbers", str: "names"}
_DEFAULT_NOTE = re.compile(r"\s*\(default: [^()]*\)$")


def add_engine_args(
    parser: argparse.ArgumentParser, names: Sequence[str], *, sweep: bool = False, **flags: Flag
) -> None:
    """Flags for these EngineConfig fields, each with the field's type, help and default unless a Flag
    of the same name gives the command's own. `model` is the positional argument (an option where a
    Flag spells it so). sweep: each flag takes a comma-separated list of values, each run as an arm
    (on/off for a switch), which sweep_values reads back. Choices and values are EngineConfig's to
    check (one line naming the flag), not argparse's."""
    unknown = sorted(set(flags) - set(names))
    assert not unknown, f"Flag for settings not asked for: {unknown}"
    for name in names:
        f, flag = FIELDS[name], flags.get(name, Flag())
        default = f.default if flag.default is _FIELDS_OWN else flag.default
        shown = _as_text(default) if sweep else default
        help_text = _help(f, flag, shown, sweep)
        if name == "model" and flag.spelling is None:
            optional: dict[str, Any] = {"nargs": "?", "metavar": "MODEL"} if flag.optional else {}
            parser.add_argument("model", help=help_text, **optional)
            continue
        option, kind = flag.spelling or _flag(name), _kind(f)
        if sweep:
            parser.add_argument(option, dest=name, default=shown, help=help_text)
        elif kind is bool:
            parser.add_argument(
                option, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            choices = flag.choices or f.metadata["choices"]
            metavar = "{" + ",".join(choices) + "}" if choices else None
            parser.add_argument(option, dest=name, type=kind, default=default, metavar=metavar, help=help_text)


def sweep_values(args: argparse.Namespace, name: str, flag: str | None = None) -> list[Any]:
    """A sweep flag's values (add_engine_args(..., sweep=True)), comma- or space-separated: each
    converted to the field's type and checked as EngineConfig checks it, in order, each once. A bad
    list is one Fp8InputError naming the flag (default: the field's own spelling)."""
    f, flag = FIELDS[name], flag or _flag(name)
    text = str(getattr(args, name))
    words = [w for w in re.split(r"[,\s]+", text) if w]
    kind = _kind(f)
    if kind is bool:
        if not words or any(w not in _SWITCH for w in words):
            raise Fp8InputError(f"{flag}: on, off or on,off, got {text!r}")
        return list(dict.fromkeys(_SWITCH[w] for w in words))
    try:
        values = [kind(w) for w in words]
    except ValueError:
        raise Fp8InputError(f"{flag}: expected {_KIND_NAMES[kind]} separated by commas, got {text!r}") from None
    for value in values:
        check_setting(name, value, flag)
    if not values:
        choices = f.metadata["choices"]
        raise Fp8InputError(f"{flag} {text!r}: one or more of {', '.join(choices or ['its values'])}, comma-separated")
    return list(dict.fromkeys(values))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(f: dataclasses.Field) -> type:
    text = str(f.type)
    for kind in (bool, int, float):
        if kind.__name__ in text:
            return kind
    return str


def _as_text(value: Any) -> Any:
    """A sweep flag's default as a user writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return None if value is None else str(value)


def _help(f: dataclasses.Field, flag: Flag, default: Any, sweep: bool) -> str:
    """The flag's help: the command's, or the field's (its default note dropped where the command has
    its own default, the values a sweep takes added), then the default where it says none."""
    text = flag.help
    if text is None:
        text = f.metadata["help"]
        if flag.default is not _FIELDS_OWN:
            text = _DEFAULT_NOTE.sub("", text)
        if sweep:
            text += _sweep_note(f)
    if default in (None, "") or "default" in text:
        return text
    return f"{text} (default: {default})"


def _sweep_note(f: dataclasses.Field) -> str:
    choices = f.metadata["choices"]
    if _kind(f) is bool:
        return ": on, off, or on,off (both, as arms)"
    if choices:
        return f": {', '.join(choices)}, or several comma-separated (each an arm)"
    return "; several comma-separated (each an arm), e.g. 1,2"


__all__ = [
    "ATTENTION",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "EngineConfig",
    "Flag",
    "add_engine_args",
    "check_setting",
    "sweep_values",
]
