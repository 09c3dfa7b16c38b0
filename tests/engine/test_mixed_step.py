"""One forward per step through fp8route's paged attention kernel: fresh chunks, chunks continuing a
cached prefix and decode rows in the same forward, a pool small enough to preempt, prefix hits; each
request's greedy tokens equal the same request computed alone by the full forward (fp32 weights).
The kernel runs on CUDA, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1 with the triton
extra, as README's test command runs it); tests/engine/test_llm_engine.py covers its torch path."""

import os

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors
from helpers import build_lm, greedy_continuation

from fp8route import SamplingParams
from fp8route.engine import EngineConfig
from fp8route.kernels import paged_attention as kernel
from fp8route.models import LlamaConfig, LlamaForCausalLM

CONFIG = {**TINY, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}  # 32-wide heads
TENSORS = {n: t.float() for n, t in llama_tensors(CONFIG).items()}
REFERENCE = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), {}, TENSORS)

pytestmark = pytest.mark.skipif(kernel.TRITON_IMPORT_ERROR is not None, reason="needs triton")
interpreted = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU"),
]


def alone(prompt: list[int], n: int) -> list[int]:
    return greedy_continuation(REFERENCE, torch.tensor([prompt]), n)[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_mixed_steps_through_the_kernel_equal_each_request_alone(device):
    config = EngineConfig(
        dtype="float32", device=device, max_num_seqs=6, max_model_len=64, num_kv_blocks=20, block_size=4,
        max_num_batched_tokens=8, use_cuda_graphs=False, record_stats=True,
    )  # fmt: skip
    tensors = {n: t.to(device) for n, t in TENSORS.items()}
    engine = build_lm(LlamaConfig.from_hf(CONFIG), {}, tensors, config).engine
    engine.runner.use_triton = True
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    shared = torch.randint(0, vocab, (12,), generator=g).tolist()
    prompts = {
        f"r{i}": (shared if i % 2 else []) + torch.randint(0, vocab, (3 + 4 * i,), generator=g).tolist()
        for i in range(6)
    }
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs: dict[str, list[int]] = {}
    arrivals = {2 * i: rid for i, rid in enumerate(prompts)}
    step = 0
    while engine.has_unfinished or step <= max(arrivals):
        if step in arrivals:
            engine.add_request(prompts[arrivals[step]], params, request_id=arrivals[step])
        for update in engine.step():
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        step += 1
    for rid, prompt in prompts.items():
        assert outputs[rid] == alone(prompt, 8), rid
    assert any(s.decodes and s.prefill_tokens for s in engine.stats)  # decodes and chunks in one forward
    assert engine.scheduler.preemptions > 0 and engine.blocks.stats.hit_tokens > 0
    assert engine.leaked() is None
