"""The runner's mixed forward: decode rows riding at the end of a packed prefill give the logits and
write the K/V that the same chunks' prefill followed by a decode step give, through the torch
reference and through the Triton decode kernel (on CUDA, or on a CPU under Triton's interpreter:
TRITON_INTERPRET=1 with the triton extra, as README's test command runs it)."""

import os

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors

from fp8route.engine import CausalLM
from fp8route.engine import paged_decode as kernel
from fp8route.engine.attention import decode_attention_torch
from fp8route.engine.runner import DecodeRows
from fp8route.models import LlamaConfig

CONFIG = {**TINY, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}  # 32-wide heads
BLOCK = 4
interpreted = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or kernel.TRITON_IMPORT_ERROR is not None,
        reason="needs triton and TRITON_INTERPRET=1 (a CPU venv with triton)",
    ),
]


def model(device: str, triton: bool) -> CausalLM:
    tensors = {n: t.to(device, torch.float32) for n, t in llama_tensors(CONFIG).items()}
    lm = CausalLM(
        LlamaConfig.from_hf(CONFIG), {}, tensors, max_batch_size=6, max_seq_len=64, dtype=torch.float32,
        device=device, use_cuda_graphs=False, num_blocks=80, block_size=BLOCK,
    )  # fmt: skip
    lm.use_triton = triton
    return lm


def blocks(lm: CausalLM, row: int, tokens: int) -> list[int]:
    taken = lm.blocks.allocate(-(-tokens // BLOCK))
    assert taken is not None
    lm.pool.set_rows([row], [taken])
    return taken


@pytest.mark.parametrize(
    ("device", "triton"),
    [
        ("cpu", False),
        pytest.param("cpu", True, marks=interpreted),
        pytest.param("cuda", False, marks=pytest.mark.gpu),
        pytest.param("cuda", True, marks=pytest.mark.gpu),
    ],
)
def test_a_mixed_forward_equals_the_prefill_then_the_decode_step(device, triton):
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 5, 14, 6, 11)]
    # Rows 0-2 decode (their prompts prefilled already, lengths 9, 5, 14: across blocks); row 3 is a
    # fresh chunk, row 4 continues a sequence whose first 5 tokens are in the cache.
    mixed, split = model(device, triton), model(device, False)
    for lm in (mixed, split):
        held = [blocks(lm, row, len(p) + 1) for row, p in enumerate(prompts)]
        lm.runner.prefill([*prompts[:3], prompts[4][:5]], [0, 0, 0, 0], [0, 1, 2, 4], [*held[:3], held[4]], [])
    chunks = [prompts[3], prompts[4][5:]]
    decodes = DecodeRows([p[-1] for p in prompts[:3]], [len(p) for p in prompts[:3]], [0, 1, 2], held[:3])
    args = (chunks, [0, 5], [3, 4], [held[3], held[4]], [0, 1])
    with torch.no_grad():
        together = mixed.runner.prefill(*args, decodes)
        prefilled = split.runner.prefill(*args)
        tokens, positions, rows = (torch.tensor(x, device=device) for x in decodes[:3])
        decoded, _ = split.runner.decode_step(tokens, positions, rows)
    assert together.shape == (5, vocab)
    torch.testing.assert_close(together, torch.cat([prefilled, decoded]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed.pool.k, split.pool.k, rtol=1e-4, atol=1e-4)  # GEMMs of other M on CUDA
    torch.testing.assert_close(mixed.pool.v, split.pool.v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
)  # fmt: skip
def test_the_decode_kernel_reads_the_tails_strided_queries(device):
    # On CUDA, RoPE leaves a prefill's queries [1, H, N, D] contiguous: the tail is a [T, H, D] view
    # with stride (D, N * D, 1), which the kernel reads in place.
    g = torch.Generator().manual_seed(1)
    h, hkv, d, n, t = 4, 2, 32, 11, 3
    q = torch.randn(1, h, n, d, generator=g).to(device)[0, :, n - t :].transpose(0, 1)
    k_blocks, v_blocks = (torch.randn(8, BLOCK, hkv, d, generator=g).to(device) for _ in range(2))
    tables = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 0], [0, 0, 0]], dtype=torch.int32, device=device)
    pages = kernel.Pages(k_blocks, v_blocks, tables, torch.tensor([0, 1, 2], device=device))
    lengths = torch.tensor([12, 5, 8], device=device)
    assert not q.is_contiguous()
    k, v = (x[tables[:3].long()].flatten(1, 2).transpose(1, 2) for x in (k_blocks, v_blocks))  # [T, Hkv, S, D]
    expected = decode_attention_torch(q, k, v, lengths)
    torch.testing.assert_close(kernel.decode_attention(q, pages, lengths), expected, rtol=1e-4, atol=1e-4)


def compiled_variants(jit) -> int:  # noqa: ANN001 - a triton JITFunction
    return sum(len(caches[0]) for caches in jit.device_caches.values())


@pytest.mark.gpu
def test_warming_the_tail_compiles_every_variant_a_tail_of_any_size_takes():
    lm = model("cuda", True)
    assert lm.runner.warm_decode_tail() == 2  # 1-4 rows of 2 KV heads split 128 positions per program, 5-6 256
    compiled = compiled_variants(kernel._split_kernel)
    pool = lm.pool
    for rows in range(1, pool.max_rows + 1):
        q = torch.randn(rows, CONFIG["num_attention_heads"], 32, device="cuda")
        pad = torch.full((rows,), pool.pad_row, device="cuda")
        kernel.decode_attention(q, kernel.Pages(*pool.layer(0), pool.tables, pad), torch.ones_like(pad))
    assert compiled_variants(kernel._split_kernel) == compiled
