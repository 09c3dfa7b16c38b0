"""The FP8 KV cache's Triton paths against the dequantized torch reference: the paged decode kernel
over e4m3 blocks (dequantized in the kernel), its fused new-token write (quantized), the RoPE +
cache-write kernel (quantized), and the engine's captured decode with kv_cache_dtype="fp8" against
its eager torch decode over the same pool.

On a GPU these run as the rest of tests/gpu. On a CPU they run under Triton's interpreter, where
"cuda" means the CPU (how they were checked before a GPU saw them):

    TRITON_INTERPRET=1 python -m pytest -q tests/gpu/test_fp8_kv_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import build_lm
from helpers import paged as paged_filled

from fp8route.engine.attention import decode_attention_torch
from fp8route.engine.kv_quant import FP8_KV, dequantize_kv, quantize_kv
from fp8route.kernels import paged_decode as da

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runs = pytest.mark.skipif(
    da.TRITON_IMPORT_ERROR is not None or not (torch.cuda.is_available() or INTERPRET),
    reason="needs triton, and CUDA or TRITON_INTERPRET=1",
)
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter, runs]
# The interpreter computes in numpy, which has no bfloat16 (its bf16 tl.dot gives garbage for any cache).
DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float32, torch.float16]


def paged(dense: torch.Tensor, page: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_filled(dense, page, seed, fill=0.0)


def assert_same_fp8(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit; under the interpreter, but for its rounding's known slip: Triton 3.9's interpreter
    drops the carry of a round-up into the next power of two (125 -> 64 where e4m3 has 128)."""
    if not INTERPRET:
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        return
    a, b = out.float(), ref.float()
    bad = a != b
    assert torch.equal(2 * a[bad], b[bad]) and bool((b[bad].abs().log2() % 1 == 0).all())
    assert bad.sum() <= 0.02 * bad.numel() + 2


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


SHAPES = [  # (B, H, Hkv, D, S, lengths, page)
    (1, 4, 2, 32, 512, [200], 16),
    (2, 4, 1, 32, 1024, [1, 1000], 8),
    (3, 8, 2, 64, 256, [64, 65, 256], 16),
]
if torch.cuda.is_available():
    SHAPES += [(1, 32, 8, 128, 32768, [32768], 16), (16, 32, 8, 128, 4096, [256 * i + 1 for i in range(16)], 16)]


LAUNCHES = [None, da.Launch(), da.Launch(f16=True), da.Launch(128, 4, 2, f16=True)]  # None: LAUNCH's for the cache


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "h", "hkv", "d", "s", "lengths", "page"), SHAPES)
def test_kernel_over_fp8_blocks_is_the_dequantized_reference(b, h, hkv, d, s, lengths, page, dtype, launch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, d, generator=g).to(DEVICE, dtype)
    k, v = (3 * torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    k_scale, v_scale = 0.02, 0.01  # 3-sigma values map to ~450 and ~900: saturation is exercised
    kq, vq = quantize_kv(k, k_scale).to(DEVICE), quantize_kv(v, v_scale).to(DEVICE)
    (k_blocks, tables), (v_blocks, _) = paged(kq, page), paged(vq, page)
    n = torch.tensor(lengths, device=DEVICE)
    pages = da.Pages(k_blocks, v_blocks, tables, torch.arange(b, device=DEVICE), k_scale, v_scale)
    out = da.decode_attention(q, pages, n, launch=launch)
    assert out.dtype == dtype
    expected = decode_attention_torch(
        q.float(), dequantize_kv(kq, k_scale, torch.float32), dequantize_kv(vq, v_scale, torch.float32), n
    )
    assert relative(out, expected) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_new_token_writes_what_rope_into_cache_writes(dtype):
    from fp8route.kernels.fused import rope, rope_into_cache
    from fp8route.models.llama import LlamaConfig, rope_tables

    b, h, hkv, d, s, page = 3, 4, 2, 32, 512, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, 1, (h + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor([0, 130, 511], device=DEVICE)
    cos, sin = (t[:, None] for t in rope_tables(LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, head_dim=d), pos))
    scales = (0.004, 0.003)  # small enough that some of the new K/V saturate
    (k_blocks, tables), (v_blocks, _) = (
        paged(quantize_kv(torch.randn(b, hkv, s, d, generator=g), sc).to(DEVICE), page) for sc in scales
    )
    rows = torch.arange(b, device=DEVICE)
    fused = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows, *scales)
    new = da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
    assert da.fuses_new_token(q[:, 0], new)
    out = da.decode_attention(q[:, 0], fused, pos + 1, new=new)
    ref = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows, *scales)
    slots = tables[rows, pos // page].long() * page + pos % page
    rope_into_cache(k, v, cos, sin, ref.k.view(-1, hkv, d), ref.v.view(-1, hkv, d), slots, scales)
    assert ref.k.dtype == FP8_KV
    assert_same_fp8(fused.k, ref.k)
    assert_same_fp8(fused.v, ref.v)
    # And both writes are the torch quantization of the rotated key (rounded to dtype) and of v.
    assert_same_fp8(ref.k.view(-1, hkv, d)[slots], quantize_kv(rope(k, cos, sin)[:, :, 0], scales[0]))
    rows_k, rows_v = (dequantize_kv(x[tables[rows].long()].flatten(1, 2).transpose(1, 2), sc, torch.float32)
                      for x, sc in zip((ref.k, ref.v), scales, strict=True))  # fmt: skip
    expected = decode_attention_torch(rope(q, cos, sin)[:, :, 0].float(), rows_k, rows_v, pos + 1)
    assert relative(out, expected) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the engine's kernel path need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_fp8_kv_captured_decode_matches_its_eager_torch_decode(dtype):
    from checkpoint_helpers import TINY, llama_tensors
    from helpers import generate_with_logits

    from fp8route.engine import EngineConfig
    from fp8route.engine.kv_quant import KVScales
    from fp8route.models import LlamaConfig

    config = {**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    tensors = {n: t.to("cuda", dtype) for n, t in llama_tensors(config).items()}
    cfg = LlamaConfig.from_hf(config)
    scales = KVScales.ones(cfg.num_hidden_layers)
    ids = torch.randint(
        0, config["vocab_size"], (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    runs = {}
    for triton, graphs in ((True, True), (False, False)):
        settings = EngineConfig(
            dtype=dtype, max_num_seqs=4, max_model_len=256, use_cuda_graphs=graphs, num_kv_blocks=128
        )
        model = build_lm(cfg, {}, tensors, settings, kv_scales=scales)
        model.engine.runner.use_triton = triton
        runs[triton] = generate_with_logits(model, ids, 24, prompt_lengths=[40, 17, 29])[1]
        assert model.engine.runner.pool.dtype == FP8_KV
    assert_same_until_a_near_tie(runs[True], runs[False])


def assert_same_until_a_near_tie(logits: torch.Tensor, reference: torch.Tensor, tol: float = 0.1) -> None:
    """Two greedy runs [B, steps, vocab] read the same history up to the first token they choose
    differently: their logits agree there, and that choice is a near-tie in the reference's logits
    (within tol of its range). After it they continue different texts, not comparable."""
    for row in range(logits.shape[0]):
        ours, ref = logits[row].float(), reference[row].float()
        differ = (ours.argmax(-1) != ref.argmax(-1)).nonzero()
        last = differ[0, 0].item() if len(differ) else ours.shape[0] - 1
        assert relative(ours[: last + 1], ref[: last + 1]) < 2e-2, (row, last)
        if len(differ):
            step = ref[last]
            gap = (step.max() - step[ours[last].argmax()]) / (step.max() - step.min())
            assert gap.item() <= tol, (row, last, gap.item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_into_cache_kernel_quantizes_as_the_torch_path(dtype, monkeypatch):
    from fp8route.kernels import fused
    from fp8route.models.llama import LlamaConfig, rope_tables

    b, hkv, d, slots_n = 4, 2, 64, 40
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(b, 1, hkv, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    pos = torch.tensor([0, 3, 17, 39], device=DEVICE)
    cos, sin = (t[:, None] for t in rope_tables(LlamaConfig(4 * d, 8 * d, 4, hkv, 1, 32, head_dim=d), pos))
    slots = torch.tensor([5, 0, 39, 12], device=DEVICE)
    scales = (0.003, 0.002)
    caches = {}
    for kernel in (True, False):
        if INTERPRET:  # the interpreter's tensors are on the CPU, where the torch path would be taken
            monkeypatch.setattr(fused, "_use_kernel", lambda x, kernel=kernel: kernel)
        elif not kernel:
            monkeypatch.setattr(fused, "_use_kernel", lambda x: False)
        k_cache, v_cache = (torch.zeros(slots_n, hkv, d, device=DEVICE, dtype=FP8_KV) for _ in range(2))
        fused.rope_into_cache(k, v, cos, sin, k_cache, v_cache, slots, scales)
        caches[kernel] = (k_cache, v_cache)
    assert_same_fp8(caches[True][0], caches[False][0])
    assert_same_fp8(caches[True][1], caches[False][1])
    written = caches[True][0].view(torch.uint8)
    assert written[slots].any() and not written[[1, 2]].any()
