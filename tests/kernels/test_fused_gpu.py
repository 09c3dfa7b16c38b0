"""The fused decoder kernels against the eager torch expressions they replace.

On a CPU they run under Triton's interpreter (fp16 only: it has no bfloat16):

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_fused_gpu.py
"""

import os

import pytest
import torch

from fp8route.kernels import fused
from fp8route.kernels.fused import (
    add_rms_norm,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_into_cache,
    rope_reference,
    silu_mul,
)
from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALF = [torch.bfloat16, torch.float16] if CUDA else [torch.float16]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(
        TRITON_IMPORT_ERROR is not None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="needs triton, and CUDA or TRITON_INTERPRET=1",
    ),
]


@pytest.fixture(autouse=True)
def kernels_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch):
    """Under the interpreter the tensors are on the CPU, where each function would take its torch
    path (the reference itself): send them to the kernels, and fail a test that ran none."""
    if CUDA:
        yield
        return
    monkeypatch.setattr(fused, "_use_kernel", lambda x: x.dtype in (torch.bfloat16, torch.float16))
    ran = []
    launch = DirectLauncher.__call__
    monkeypatch.setattr(DirectLauncher, "__call__", lambda self, *a: ran.append(self.fn) or launch(self, *a))
    yield
    assert ran, "no kernel ran: the test compared the torch path with itself"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 1, 4096), (3, 17, 4096), (2, 5, 8, 128), (7, 576)])
def test_rms_norm(dtype, shape):
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 1, 4096), (3, 17, 4096), (7, 576)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, shape):
    x, r = (torch.randn(shape, device=DEVICE, dtype=dtype) * 3 for _ in range(2))
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    normed, total = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)  # the sum is rounded once, as the eager add rounds it
    torch.testing.assert_close(normed, rms_norm_reference(x + r, w, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("b", "t", "heads", "dim"), [(1, 1, 32, 128), (4, 1, 8, 128), (2, 37, 8, 64)])
def test_rope_shared_and_per_row_positions(dtype, b, t, heads, dim):
    qkv = torch.randn(b, t, heads * dim * 2, device=DEVICE, dtype=dtype)
    x = qkv[..., : heads * dim].reshape(b, t, heads, dim)  # a strided view, as the split gives it
    angles = torch.rand(b, t, dim // 2, device=DEVICE) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected = rope_reference(x.transpose(1, 2), cos[:, None], sin[:, None])
    torch.testing.assert_close(rope(x, cos, sin), expected, rtol=1e-2, atol=1e-2)
    shared = rope_reference(x.transpose(1, 2), cos[0], sin[0])
    torch.testing.assert_close(rope(x, cos[0], sin[0]), shared, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", HALF)
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 5, 2 * 1500, device=DEVICE, dtype=dtype) * 4
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up, 1500), torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", HALF)
def test_rope_into_cache_writes_each_row_at_its_slot(dtype):
    b, heads, dim, slots = 3, 8, 128, 50
    kv = torch.randn(b, 1, 2 * heads * dim, device=DEVICE, dtype=dtype)
    k = kv[..., : heads * dim].reshape(b, 1, heads, dim)
    v = kv[..., heads * dim :].reshape(b, 1, heads, dim)
    angles = torch.rand(b, 1, dim // 2, device=DEVICE) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    where = torch.tensor([0, 17, 49], device=DEVICE)
    k_cache = torch.full((slots, heads, dim), float("nan"), device=DEVICE, dtype=dtype)  # a pool viewed by slot
    v_cache = k_cache.clone()
    rope_into_cache(k, v, cos, sin, k_cache, v_cache, where)
    expected_k = rope_reference(k.transpose(1, 2), cos[:, None], sin[:, None])[:, :, 0]
    torch.testing.assert_close(k_cache[where], expected_k, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v_cache[where], v[:, 0], rtol=0, atol=0)
    assert int((~k_cache.isnan()).sum()) == b * heads * dim  # nothing else written


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_rope_into_cache_stages_the_rows_as_the_cache_gives_them_back(dtype, fp8):
    """staged: each row's rotated key and value as read back from the cache (an fp8 one: e4m3 times
    its scale), bit for bit, besides the cache write itself."""
    b, heads, dim, slots = 5, 4, 64, 20
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(b, 1, heads, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    angles = torch.rand(b, 1, dim // 2, generator=g).to(DEVICE) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    where = torch.tensor([3, 0, 19, 7, 11], device=DEVICE)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_cache, v_cache = (torch.zeros(slots, heads, dim, device=DEVICE, dtype=cache_dtype) for _ in range(2))
    scales = (0.02, 0.03) if fp8 else None
    staged = torch.full((2, b + 3, heads, dim), float("nan"), device=DEVICE, dtype=dtype)
    rope_into_cache(k, v, cos, sin, k_cache, v_cache, where, scales, (staged[0, :b], staged[1, :b]))
    for i, cache in enumerate((k_cache, v_cache)):
        read = cache[where].float() * scales[i] if scales else cache[where]
        assert torch.equal(staged[i, :b], read.to(dtype))
    assert staged[:, b:].isnan().all()  # rows past the step untouched
