"""DirectLauncher's kernels in one process with calls that differ only in a constexpr: each call
must run the kernel compiled for its own constexprs, whatever ran before it.

On the H200 (triton 3.6, direct launches) rope's launcher keyed a head size of 64 or 128 like the
head size of 32 that tests/gpu/test_fp8_kv_gpu.py had compiled first (HALF is a constexpr that the
key's stride classes did not tell apart): rope wrote 32 of each head's values and left the rest of
its torch.empty output as it was, so the unfused reference of every fused-new-token case (and the
engine's eager decode) read NaN. The launcher now keys by meta's values too (4eaa5f6 added the head
size to rope's own key on main).

On a GPU these run the real direct path. Under Triton's interpreter (CPU tensors; Triton 3.9, whose
kernels DirectLauncher never launches directly) a stand-in plays triton 3.6's compiled kernel: it is
launched with the constexprs it was compiled with, whatever the call gives, as a binary is:

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_launch_keys_gpu.py
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import paged

from fp8route.engine.kv_quant import FP8_KV, quantize_kv
from fp8route.kernels import launcher
from fp8route.kernels import paged_decode as da
from fp8route.models.llama import LlamaConfig, rope_tables

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(
        da.TRITON_IMPORT_ERROR is not None or not (CUDA or INTERPRET),
        reason="needs triton, and CUDA or TRITON_INTERPRET=1",
    ),
]
# The interpreter's bf16 tl.dot is broken (numpy has no bfloat16): fp16 there.
DTYPE = torch.bfloat16 if CUDA else torch.float16


class _Binary:
    """Under the interpreter: a compiled kernel, launched with the constexprs it was built with."""

    function = packed_metadata = None

    def __init__(self, fn: Any, runtime: int, baked: dict[str, Any]) -> None:
        self.fn, self.runtime, self.baked = fn, runtime, baked

    def run(self, gx: int, gy: int, gz: int, stream: Any, function: Any, packed: Any, *rest: Any) -> None:
        args = rest[3:]  # after the launch metadata and the two hooks
        self.fn[(gx, gy, gz)](*args[: self.runtime], **self.baked)  # the call's constexprs are ignored


class _Compiling:
    """Under the interpreter: the JIT function as triton 3.6's, whose fn[grid](...) returns its binary."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.__name__ = fn, fn.__name__
        params = inspect.signature(fn.fn).parameters
        self.params = [SimpleNamespace(name=n) for n in params]
        self.constexprs = [n for n, p in params.items() if "constexpr" in str(p.annotation)]

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, **meta: Any) -> _Binary:
            self.fn[grid](*args, **meta)
            return _Binary(self.fn, len(args), {n: meta[n] for n in self.constexprs})

        return run


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> Any:
    """fp8route.kernels.fused with fresh launchers (nothing compiled before this test), direct."""
    from fp8route.kernels import fused

    for name in ("_ROPE", "_ROPE_STORE"):
        monkeypatch.setattr(getattr(fused, name), "_compiled", {})
    if INTERPRET:
        monkeypatch.setattr(launcher, "DIRECT", True)
        monkeypatch.setattr(launcher, "_no_launch_hooks", lambda: True)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
        monkeypatch.setattr(fused, "_use_kernel", lambda x: True)  # CPU tensors here
        for name in ("_ROPE", "_ROPE_STORE"):
            monkeypatch.setattr(getattr(fused, name), "fn", _Compiling(getattr(fused, name).fn))
    return fused


def qkv_and_tables(b: int, h: int, hkv: int, d: int, pos: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, 1, heads, D] as views of one GEMM output, cos/sin [B, 1, D] fp32 (as the engine has them)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, 1, (h + 2 * hkv) * d, generator=g).to(DEVICE, DTYPE)
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    cos, sin = (t[:, None] for t in rope_tables(LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, head_dim=d), pos))
    return q, k, v, cos, sin


def test_rope_head_sizes_alike_in_their_strides_each_get_their_kernel(fused: Any) -> None:
    # Every stride of these is a multiple of 16 and there is one token a row: one key class.
    pos = torch.tensor([0, 7, 300], device=DEVICE)
    for d in (32, 128, 64, 32):
        q, _, _, cos, sin = qkv_and_tables(3, 4, 2, d, pos)
        out = fused.rope(q, cos, sin)
        expected = fused.rope_reference(q.transpose(1, 2), cos[:, None], sin[:, None])
        assert not out.isnan().any(), d
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2, msg=f"head size {d}")


def test_rope_into_cache_16_bit_after_fp8_and_across_head_sizes(fused: Any) -> None:
    pos = torch.tensor([0, 7, 300], device=DEVICE)
    slots = torch.tensor([5, 0, 9], device=DEVICE)
    for d, scales in ((32, (0.004, 0.003)), (32, None), (128, None), (128, (0.004, 0.003)), (64, None)):
        _, k, v, cos, sin = qkv_and_tables(3, 4, 2, d, pos)
        dtype = FP8_KV if scales is not None else DTYPE
        k_cache, v_cache = (torch.zeros(12, 2, d, device=DEVICE, dtype=dtype) for _ in range(2))
        fused.rope_into_cache(k, v, cos, sin, k_cache, v_cache, slots, scales)
        k_new = fused.rope_reference(k.transpose(1, 2), cos[:, None], sin[:, None])[:, :, 0]
        v_new = v[:, 0]
        if scales is not None:  # indexed as bytes: float8 has few indexing kernels
            k_new, v_new = (quantize_kv(x, s) for x, s in zip((k_new, v_new), scales, strict=True))
            assert_same_e4m3(k_cache.view(torch.uint8)[slots].view(FP8_KV), k_new)
            assert_same_e4m3(v_cache.view(torch.uint8)[slots].view(FP8_KV), v_new)
        else:
            torch.testing.assert_close(k_cache[slots], k_new, rtol=1e-2, atol=1e-2, msg=f"head size {d}")
            assert torch.equal(v_cache[slots], v_new)
        untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for cache in (k_cache, v_cache):  # all bits zero where no row wrote
            assert not cache.view(torch.int8 if scales is not None else torch.int16)[untouched].any()


def assert_same_e4m3(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one e4m3 step (the kernel rotates in fp32, the reference rounds then rotates); under the
    interpreter also its known slip, a round-up into the next power of two that loses the carry (a
    half), as tests/gpu/test_fp8_kv_gpu.py allows it."""
    a, b = out.float(), ref.float()
    ok = (a - b).abs() <= b.abs() / 8 + 2**-9
    if INTERPRET:
        ok |= (2 * a == b) & (b.abs().log2() % 1 == 0)
    assert bool(ok.all()), (a[~ok], b[~ok])


def new_token_case(fused: Any, d: int, scales: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused new token's attention, and the unfused reference's (rope_into_cache, rope, decode)."""
    b, h, hkv, s, page = 3, 8, 2, 256, 16
    pos = torch.tensor([0, 130, 255], device=DEVICE)
    q, k, v, cos, sin = qkv_and_tables(b, h, hkv, d, pos, seed=d)
    g = torch.Generator().manual_seed(1)
    dense = [torch.randn(b, hkv, s, d, generator=g) for _ in range(2)]
    if scales is None:
        (k_blocks, tables), (v_blocks, _) = (paged(x.to(DEVICE, DTYPE), page, None, 0.0) for x in dense)
    else:
        (k_blocks, tables), (v_blocks, _) = (
            paged(quantize_kv(x, sc).to(DEVICE), page, None, 0.0) for x, sc in zip(dense, scales)
        )
    rows = torch.arange(b, device=DEVICE)
    extra = scales if scales is not None else ()
    out = da.decode_attention(
        q[:, 0], da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows, *extra), pos + 1,
        new=da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]),
    )  # fmt: skip
    ref = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows, *extra)
    slots = tables[rows, pos // page].long() * page + pos % page
    fused.rope_into_cache(k, v, cos, sin, ref.k.view(-1, hkv, d), ref.v.view(-1, hkv, d), slots, scales)
    return out, da.decode_attention(fused.rope(q, cos, sin)[:, :, 0].contiguous(), ref, pos + 1)


def test_unfused_16_bit_new_token_after_fp8_ones_of_another_head_size(fused: Any) -> None:
    # The order tests/gpu/test_fp8_kv_gpu.py then tests/kernels/test_paged_decode_gpu.py ran in on the H200.
    for d, scales in ((32, (0.004, 0.003)), (128, None), (64, None), (32, None)):
        out, expected = new_token_case(fused, d, scales)
        assert not expected.isnan().any() and not out.isnan().any(), (d, scales)
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < (2e-2 if scales is not None else 1e-2), (d, scales, error)
