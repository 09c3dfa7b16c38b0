"""Compile every fp8route Triton kernel for the H200 (sm_90) on a machine without a GPU.

The kernels are reached through their real entry points (decode_gemm, the fused norms, RoPE and
SiLU, quantize_fp8, decode_attention, paged_attention, argmax, the tensor-parallel reduce) with CPU tensors of
Llama-3.1-8B's shapes (one GPU's and a TP2 rank's) and SmolLM2-135M's, under a Triton driver
that targets sm_90 and launches nothing. So each kernel is specialized and compiled as a GPU run
would (same constexprs, dtypes, integer and alignment classes, launch options), through Triton's
own pipeline and its bundled ptxas down to a cubin, and checked for what a launch checks first
(shared memory, threads). Each compile's registers and spilled bytes come from cuobjdump.

    python -m fp8route.kernels.compile_check

tests/kernels/test_compile_sm90.py runs the same sweep in CI. What this cannot see: anything at
run time (numerics are the other tests/kernels' own, under Triton's interpreter on a CPU or on the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fp8route.device import usable_cores

FAKE_DEVICE = -1  # the index Triton keys these compiles by: never a real GPU's
H200_SHARED = 232448  # bytes of shared memory a block may use on sm_90 (227 KB)
# The batch sizes the engine's decode graphs capture (fp8route.engine.decode_graphs.buckets, which
# tests/kernels/test_compile_sm90.py holds this to) up to the decode GEMM's M_MAX.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128)


@dataclass(frozen=True)
class Model:
    """The dimensions a rank's kernels see: heads and the MLP width already divided by the TP size."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def gemms(self) -> dict[str, tuple[int, int]]:
        """(N, K) of the projections."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {"qkv": (qkv, self.hidden), "o": (self.hidden, self.heads * self.head_dim),
                "gate_up": (2 * self.inter, self.hidden), "down": (self.hidden, self.inter)}  # fmt: skip


MODELS = {
    "llama-3.1-8b": Model(4096, 14336, 32, 8, 128, 128256),
    "llama-3.1-8b tp2": Model(4096, 7168, 16, 4, 128, 128256),
    "smollm2-135m": Model(576, 1536, 9, 3, 64, 49152),  # README's real model: odd widths, 64-wide heads
}


@dataclass
class Compiled:
    kernel: str
    constexprs: str
    num_warps: int
    num_stages: int
    shared: int
    registers: int | None
    spilled: int | None
    pdl_wait: bool
    wgmma: bool
    wide_ints: list[str]  # integer arguments passed as 64-bit (Triton specializes on whether they fit 32)
    # The layout of each 1-D fp32 tensor reduced to a scalar: what orders a row's sum (two kernels
    # whose sums of the same values take the same layout add them in the same order).
    row_sums: list[str]


LAUNCHED: list[tuple[Any, ...]] = []  # what each launch handed the launcher, while recording


class _Launches:
    """A Triton launcher that launches nothing (and records its arguments in LAUNCHED)."""

    def __init__(self, src: Any, metadata: Any) -> None:
        pass

    def __call__(self, *args: Any) -> None:
        LAUNCHED.append(args)


class _Utils:
    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[Any, ...]:
        return None, None, 0, 0, 1024  # module, function, registers, spills, max threads per block

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": H200_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


def _driver() -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.backends.nvidia.driver import ty_to_cpp

    class CompileOnlySm90(DriverBase):
        def __init__(self) -> None:
            self.utils = _Utils()
            self.launcher_cls = _Launches

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty_to_cpp(ty)

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_current_device(self) -> int:
            return FAKE_DEVICE

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("compile only")

        def get_empty_cache_for_benchmark(self) -> Any:
            raise NotImplementedError("compile only")

        def clear_cache(self, cache: Any) -> None:
            pass

    return CompileOnlySm90()


@contextlib.contextmanager
def compile_only_sm90() -> Iterator[None]:
    """fp8route's kernel entry points on CPU tensors compile for an H200 and launch nothing."""
    import triton

    from fp8route.device import DeviceInfo
    from fp8route.kernels import fused, fused_quantize, launcher, options
    from fp8route.kernels.decode_gemm import launch

    h200 = DeviceInfo(type="cuda", capability=(9, 0), name="NVIDIA H200", sm_count=132, l2_bytes=60 * 2**20)
    saved = (launcher._no_launch_hooks, launch._device, fused._use_kernel, fused_quantize.fusable, options._current[0])
    config = triton.runtime.driver  # its active driver: `_active` from Triton 3.5 on (None until used), `active` before
    field = "_active" if "_active" in vars(config) else "active"
    active = vars(config)[field]
    config.set_active(_driver())
    # Every launch through Triton's own path (the direct one reads a CUDA stream), tuned as on an
    # H200, and the fused ops on their kernels whatever the tensors' device.
    launcher._no_launch_hooks = lambda: False
    launch._device = lambda device: h200  # type: ignore[assignment]  # a cached function, stood in for
    fused._use_kernel = lambda x: x.dtype in (torch.bfloat16, torch.float16) and not torch.compiler.is_compiling()
    fused_quantize.fusable = fused._use_kernel
    try:
        yield
    finally:
        launcher._no_launch_hooks, launch._device, fused._use_kernel, fused_quantize.fusable, options._current[0] = (
            saved
        )
        setattr(config, field, active)
        # Nothing compiled here may be launched later: its launcher launches nothing.
        launch._LAUNCHES.clear()
        for fn in _kernel_functions():
            fn.device_caches.pop(FAKE_DEVICE, None)
        for value in _launchers():
            value._compiled.clear()


def _with_pdl(pdl: bool) -> None:
    from fp8route.kernels import options

    options._current[0] = options.KernelOptions(pdl=pdl)


def _decode_gemms(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels.decode_gemm.configs import why_not
    from fp8route.kernels.decode_gemm.launch import launch
    from fp8route.quant import FP8_DTYPE

    one = torch.ones((), dtype=torch.float32)
    for n, k in model.gemms.values():
        weight = torch.empty((n, k), dtype=FP8_DTYPE)
        for m in DECODE_BATCHES:
            if why_not(m, n, k) is not None:  # a plan would route this shape elsewhere
                continue
            launch(torch.empty((m, k), dtype=dtype), weight, one, one, None, dtype)
            if m in (1, 64):  # x quantized before (a prefill-quantized input), and a bias (Qwen's qkv)
                launch(torch.empty((m, k), dtype=FP8_DTYPE), weight, one, one, None, dtype)
                launch(torch.empty((m, k), dtype=dtype), weight, one, one, torch.empty(n, dtype=dtype), dtype)


def _schemes(model: Model, dtype: torch.dtype) -> None:
    """The channel and block schemes' kernels: the dynamic quantizers, the decode GEMM quantizing x
    per token or group inside, and the block-scaled GEMM (x quantized inside, or handed over). In
    bf16 and at the decode batches that change the kernel's tiling: every variant compiles in about
    a second, and CI's two cores compile them all."""
    if dtype != torch.bfloat16:
        return
    from fp8route.kernels import block_gemm, quantize
    from fp8route.kernels.decode_gemm.configs import why_not
    from fp8route.kernels.decode_gemm.launch import launch
    from fp8route.quant import FP8_DTYPE
    from fp8route.schemes import BLOCK, cdiv

    for n, k in model.gemms.values():
        weight = torch.empty((n, k), dtype=FP8_DTYPE)
        scales = {"channel": torch.ones(n), "block": torch.ones(cdiv(n, BLOCK), cdiv(k, BLOCK))}
        for scheme, w_scale in scales.items():
            for m in (1, 4, 16, 32, 64, 128):
                if why_not(m, n, k) is None:
                    launch(torch.empty((m, k), dtype=dtype), weight, w_scale, None, None, dtype, scheme=scheme)
        for m in (1, 64, 300, 8192):
            x = torch.empty((m, k), dtype=dtype)
            block_gemm.launch(x, weight, scales["block"], None, dtype)
            x_q, x_scale = torch.empty((m, k), dtype=FP8_DTYPE), torch.ones(m, cdiv(k, BLOCK))
            block_gemm.launch(x_q, weight, scales["block"], None, dtype, x_scale=x_scale)
    for rows in (1, 64, 8192):
        x = torch.empty((rows, model.hidden), dtype=dtype)
        quantize.quantize_per_token(x)
        quantize.quantize_per_group(x)
        quantize.quantize_per_group(x, m_major=True)


def _fused(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels import fused
    from fp8route.kernels import fused_quantize as fq
    from fp8route.kernels.quantize import quantize_fp8
    from fp8route.quant import FP8_DTYPE

    hidden, heads, kv, dim = model.hidden, model.heads, model.kv_heads, model.head_dim
    w, one = torch.empty(hidden, dtype=dtype), torch.ones((), dtype=torch.float32)
    specs = (
        fq.XQuant("tensor", input_scale=one),
        fq.XQuant("block"),
        fq.XQuant("block", m_major=True, rows=4),
        fq.XQuant("channel"),
    )
    for rows in (1, 64, 8192):
        x = torch.empty((rows, hidden), dtype=dtype)
        gate_up = torch.empty((rows, 2 * model.inter), dtype=dtype)
        fused.rms_norm(x, w, 1e-5)
        fused.add_rms_norm(x, torch.empty_like(x), w, 1e-5)
        fused.silu_mul(gate_up, model.inter)
        quantize_fp8(x, one)
        for spec in specs:  # the norms and SiLU-up quantizing x as the next GEMM reads it
            fq.rms_norm_quantized(x, w, 1e-5, spec)
            fq.add_rms_norm_quantized(x, torch.empty_like(x), w, 1e-5, spec)
            if spec.scheme != "channel":
                fq.silu_mul_quantized(gate_up, model.inter, spec)
    # A prefill chunk past 2^31 elements takes 64-bit offsets (never touched: nothing launches).
    quantize_fp8(torch.empty((2**31 // hidden + 1, hidden), dtype=dtype), one)
    for b, t in ((1, 4096), (4, 2048), (64, 1)):
        qkv = torch.empty((b, t, heads + 2 * kv, dim), dtype=dtype)
        cos, per_row = torch.empty((t, dim)), torch.empty((b, t, dim))
        fused.rope(qkv[:, :, :heads], cos, cos)
        fused.rope(qkv[:, :, heads : heads + kv], cos, cos, token_major=True)
        fused.rope(qkv[:, :, :heads], per_row, per_row)
    for b in (1, 64):
        qkv = torch.empty((b, 1, heads + 2 * kv, dim), dtype=dtype)
        k, v = qkv[:, :, heads : heads + kv], qkv[:, :, heads + kv :]
        cos, slots = torch.empty((b, 1, dim)), torch.zeros(b, dtype=torch.int64)
        for cache_dtype, scales in ((dtype, None), (FP8_DTYPE, (0.5, 0.25))):
            cache = torch.empty((4096, kv, dim), dtype=cache_dtype)
            fused.rope_into_cache(k, v, cos, cos, cache, torch.empty_like(cache), slots, scales)
            staged = torch.empty((2, b + 127, kv, dim), dtype=dtype)  # a step with fresh chunks on their own
            fused.rope_into_cache(k, v, cos, cos, cache, torch.empty_like(cache), slots, scales, (staged[0], staged[1]))


def _attention(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels import paged_decode as pd
    from fp8route.quant import FP8_DTYPE

    heads, kv, dim = model.heads, model.kv_heads, model.head_dim
    page, max_blocks = 16, 8192 // 16
    for b in (1, 16, 64):
        qkv = torch.empty((b, heads + 2 * kv, dim), dtype=dtype)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]
        cos = torch.empty((b, dim))
        tables = torch.zeros((b + 1, max_blocks), dtype=torch.int32)
        rows, lengths = torch.arange(b), torch.ones(b, dtype=torch.int64)
        for cache_dtype, scales in ((dtype, (1.0, 1.0)), (FP8_DTYPE, (0.5, 0.25))):
            blocks = torch.empty((b * max_blocks, page, kv, dim), dtype=cache_dtype)
            pages = pd.Pages(blocks, torch.empty_like(blocks), tables, rows, *scales)
            pd.decode_attention(q, pages, lengths, new=pd.NewToken(k, v, cos, cos))
            pd.decode_attention(q.contiguous(), pages, lengths)


def _paged_attention(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels import paged_attention as pa
    from fp8route.kernels import paged_decode as pd
    from fp8route.quant import FP8_DTYPE

    heads, kv, dim = model.heads, model.kv_heads, model.head_dim
    page, max_blocks = 16, 8192 // 16
    # Decode rows alone (a decode graph's bucket), and a mixed step: decode rows then chunks; the decode
    # rows through the one-query grid, and through the decode kernel at the deterministic mode's split.
    for singles, queries in ((64, [1] * 64), (3, [1, 1, 1, 2048, 17])):
        q = torch.empty((sum(queries), heads, dim), dtype=dtype)
        cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
        seqs = pa.Sequences(cu, torch.ones(len(queries), dtype=torch.int32), torch.arange(len(queries)), singles)
        tables = torch.zeros((len(queries) + 1, max_blocks), dtype=torch.int32)
        for cache_dtype, scales in ((dtype, (1.0, 1.0)), (FP8_DTYPE, (0.5, 0.25))):
            blocks = torch.empty((len(queries) * max_blocks, page, kv, dim), dtype=cache_dtype)
            cache = pa.PagedKV(blocks, torch.empty_like(blocks), tables, *scales)
            for decode_split in (None, pd.FIXED_SPLIT):
                pa.paged_attention(q, cache, seqs, decode_split=decode_split)
            # The counts on the device, the grids from bounds (a captured step's form).
            counts = torch.tensor([singles, len(queries)], dtype=torch.int32)
            pa.paged_attention(q, cache, replace(seqs, counts=counts))
    if dtype != torch.bfloat16:
        return  # the float32 case below is the same compile in every pass
    # A float32 engine's pool holds float32 blocks: tiles of twice the bytes.
    q = torch.empty((2048, heads, dim), dtype=torch.float32)
    blocks = torch.empty((max_blocks, page, kv, dim), dtype=torch.float32)
    cu = torch.tensor([0, 2048], dtype=torch.int32)
    seqs = pa.Sequences(cu, torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 0)
    tables = torch.zeros((2, max_blocks), dtype=torch.int32)
    pa.paged_attention(q, pa.PagedKV(blocks, torch.empty_like(blocks), tables), seqs)


def _argmax(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels.argmax import argmax_rows

    for rows in (1, 64):
        argmax_rows(torch.empty((rows, model.vocab), dtype=dtype))


def _sampling(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels import sampling

    vocab = model.vocab
    for rows in (1, 64):
        x = torch.empty((rows, vocab), dtype=torch.float32)
        where, ints = torch.arange(rows), torch.zeros(rows, dtype=torch.int64)
        values = torch.ones(rows)
        logits = torch.empty((rows, vocab), dtype=dtype)
        for source in (logits, x):
            sampling.process(source, x, where, torch.empty((rows, vocab), dtype=torch.int32),
                             torch.empty((rows, vocab), dtype=torch.bool), torch.ones(3, rows))  # fmt: skip
            sampling.process(source, x, where, None, None, None)
        sampling.apply_bitmask_(x, where, torch.empty((rows, -(-vocab // 32)), dtype=torch.int32))
        sampling.nucleus_floor(x, where, values, values, values, values)
        sampling.draw(x, where, values, values, values, ints, ints, ints)
        for k in (20, 40):
            candidates, ids = torch.empty((rows, k)), torch.zeros((rows, k), dtype=torch.int64)
            sampling.draw_top_k(candidates, ids, ints, values, values, values, values, ints, ints, ints)
        for k in (5, 40):
            sampling.top_candidates(x, where, k)
        sampling.top_candidates(logits, where, 5)
        sampling.logprob_stats(logits, where, ints)


def _peer_reduce(model: Model, dtype: torch.dtype) -> None:
    from fp8route.kernels import peer_reduce

    w = torch.empty(model.hidden, dtype=dtype)
    for world in (2, 4):
        buffers = torch.zeros(world, dtype=torch.int64)
        for rank in range(world):
            for rows in (1, 64):
                x = torch.empty((rows, model.hidden), dtype=dtype)
                peer_reduce.launch(x, torch.empty_like(x), w, 1e-5, buffers, rank, 256, 0)


def _fixed_gemm(model: Model, dtype: torch.dtype) -> None:
    """The deterministic mode's GEMM in each scaling, split (a decode batch) and whole (a prefill), and
    the lm_head's 16-bit product."""
    from fp8route.kernels.fixed_gemm import TILINGS, fixed_gemm
    from fp8route.quant import FP8_DTYPE
    from fp8route.schemes import BLOCK, cdiv

    for n, k in model.gemms.values():
        weight = torch.empty((n, k), dtype=FP8_DTYPE)
        groups = cdiv(k, BLOCK)
        for tiles in TILINGS.values():
            for m in (1, 8192):
                if tiles.quantize_x:  # 16-bit x: a static scale, or per 1x128 group beside weight blocks
                    x = torch.empty((m, k), dtype=dtype)
                    fixed_gemm(x, weight, torch.ones(()), torch.ones(()), None, dtype, tiles)
                    fixed_gemm(x, weight, None, torch.ones(cdiv(n, BLOCK), groups), None, dtype, tiles)
                    continue
                x = torch.empty((m, k), dtype=FP8_DTYPE)
                fixed_gemm(x, weight, torch.ones(()), torch.ones(()), None, dtype, tiles)
                fixed_gemm(x, weight, torch.ones(m), torch.ones(n), None, dtype, tiles)
                block_scales = (torch.ones(m, groups), torch.ones(cdiv(n, BLOCK), groups))
                fixed_gemm(x, weight, *block_scales, None, dtype, tiles)
    head = torch.empty((model.vocab, model.hidden), dtype=dtype)
    for m in (1, 256):
        fixed_gemm(torch.empty((m, model.hidden), dtype=dtype), head, None, None, None, dtype)


SWEEPS: dict[str, Callable[[Model, torch.dtype], None]] = {
    "decode_gemm": _decode_gemms,
    "schemes": _schemes,  # per-channel and block-scaled FP8: quantizers, decode GEMM, block GEMM
    "fused": _fused,
    "attention": _attention,
    "paged_attention": _paged_attention,
    "argmax": _argmax,
    "sampling": _sampling,  # the sampler: processing, bitmask, top-k candidates, top_p search, draw, logprobs
    "peer_reduce": _peer_reduce,  # tensor parallel's all-reduce fused with the norm after it
    "fixed_gemm": _fixed_gemm,  # the deterministic mode's GEMM
}


def compile_all(
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16), workers: int | None = None
) -> list[Compiled]:
    """Every sweep for every model at every activation dtype, with and without PDL (where this
    Triton can): what each compiled. When the first (PDL, dtype) pass compiles anything (Triton's
    on-disk cache is cold), the other passes are compiled into that cache by `workers` processes
    (default: the cores this process may use) before this process reads them back."""
    from fp8route.kernels.options import triton_compiles_pdl

    pdls = (False, True) if triton_compiles_pdl() else (False,)
    passes = [(pdl, dtype) for pdl in pdls for dtype in dtypes]
    with compile_only_sm90():
        LAUNCHED.clear()
        cached = _cache_entries()
        _sweep_pass(*passes[0])
        if _cache_entries() != cached:
            _fill_cache(passes[1:], workers or usable_cores())
        for pdl, dtype in passes[1:]:
            _sweep_pass(pdl, dtype)
        LAUNCHED.clear()
        return [_describe(fn, kernel) for fn in _kernel_functions() for kernel in _compiled(fn)]


def _sweep_pass(pdl: bool, dtype: torch.dtype) -> None:
    _with_pdl(pdl)
    for model in MODELS.values():
        for sweep in SWEEPS.values():
            sweep(model, dtype)


def _cache_entries() -> int | None:
    """How many entries Triton's on-disk cache holds (None where this Triton does not say where it is)."""
    from triton import knobs

    folder = getattr(getattr(knobs, "cache", None), "dir", None)
    return sum(1 for _ in Path(folder).iterdir()) if folder and Path(folder).is_dir() else None


def _fill_cache(passes: list[tuple[bool, torch.dtype]], workers: int) -> None:
    """Each (PDL, dtype) pass compiled in a process of its own, `workers` at a time, into Triton's
    on-disk cache. Compiles are CPU-bound and the passes share no variant but a few dtype-free sampler
    kernels: the whole sweep took 353 s in one process on a 2-core machine with a cold cache, 4 s warm."""
    if workers < 2 or not passes:
        return
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA or driver state inherited
    with ProcessPoolExecutor(min(workers, len(passes)), mp_context=context) as pool:
        list(pool.map(_compile_pass, [pdl for pdl, _ in passes], [str(d).removeprefix("torch.") for _, d in passes]))


def _compile_pass(pdl: bool, dtype: str) -> None:
    with compile_only_sm90():
        _sweep_pass(pdl, getattr(torch, dtype))


def _module_values() -> Iterator[Any]:
    """Every global of every fp8route module imported so far."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fp8route."):
            yield from vars(module).values()


def _kernel_functions() -> list[Any]:
    from triton.runtime.jit import JITFunction

    found: dict[int, Any] = {}
    for value in _module_values():
        for fn in (value, getattr(value, "fn", None)):  # a DirectLauncher holds its kernel
            if isinstance(fn, JITFunction):
                found[id(fn)] = fn
    return sorted(found.values(), key=lambda fn: fn.__name__)


def _launchers() -> list[Any]:
    from fp8route.kernels.launcher import DirectLauncher

    return [value for value in _module_values() if isinstance(value, DirectLauncher)]


def _compiled(fn: Any) -> list[Any]:
    cache = fn.device_caches.get(FAKE_DEVICE)
    return list(cache[0].values()) if cache is not None else []


def _describe(fn: Any, kernel: Any) -> Compiled:
    names = fn.arg_names
    constants = {names[key[0]] if isinstance(key, tuple) else key: v for key, v in kernel.src.constants.items()}
    shown = ",".join(f"{k}={_short(v)}" for k, v in constants.items() if fn.params[names.index(k)].is_constexpr)
    first = kernel.src.signature[names[0]].lstrip("*")  # the activations' dtype, in most kernels
    ptx = kernel.asm["ptx"]
    regs, spilled = _resource_usage(kernel.asm["cubin"])
    return Compiled(
        kernel=fn.__name__,
        constexprs=f"{names[0]}:{first} {shown}",
        num_warps=kernel.metadata.num_warps,
        num_stages=kernel.metadata.num_stages,
        shared=kernel.metadata.shared,
        registers=regs,
        spilled=spilled,
        pdl_wait="griddepcontrol.wait" in ptx,
        wgmma="wgmma.mma_async" in ptx,
        wide_ints=[name for name, ty in kernel.src.signature.items() if ty in ("i64", "u64")],
        row_sums=_row_sums(kernel.asm["ttgir"]),
    )


def _row_sums(ttgir: str) -> list[str]:
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*?>)$", ttgir, re.M))
    return [layouts[name] for name in re.findall(r"\}\) : \(tensor<\d+xf32, (#\w+)>\) -> f32", ttgir)]


def _short(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    # Spilled registers live in the thread's stack frame (STACK); LOCAL counts none of them.
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import triton

    start = time.perf_counter()
    rows = compile_all()
    seconds = time.perf_counter() - start
    head = f"{'kernel':26s} {'warps':>5s} {'stages':>6s} {'shared KB':>9s} {'regs':>4s} {'spill B':>7s}"
    print(f"{head} pdl wgmma  constexprs")
    for r in rows:
        print(
            f"{r.kernel:26s} {r.num_warps:5d} {r.num_stages:6d} {r.shared / 1024:9.1f} {r.registers or '?':>4} "
            f"{r.spilled if r.spilled is not None else '?':>7} {int(r.pdl_wait):3d} {int(r.wgmma):5d}  {r.constexprs}"
            + (f" 64-bit:{','.join(r.wide_ints)}" if r.wide_ints else "")
        )
    spills = [r for r in rows if r.spilled]
    print(
        f"\n{len(rows)} compiles for sm_90 with triton {triton.__version__} in {seconds:.0f} s; "
        f"{len(spills)} spill to local memory; largest shared {max(r.shared for r in rows) / 1024:.1f} KB "
        f"of {H200_SHARED / 1024:.0f}"
    )


if __name__ == "__main__":
    main()
