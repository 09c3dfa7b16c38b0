"""The deterministic mode through fp8route's Triton attention (the GPU's path): decode rows through the
paged kernel's one-query grid in decode and mixed steps alike, a prompt's one-token piece through its
multi-query grid, prefix blocks registered for prompt positions only. Each request's tokens and
logprobs are the same alone, together, staggered into a running load with chunked prefill, and with the
prefix cache warm. On CUDA (bf16, the fixed-tile GEMM for the float linears), or on a CPU under Triton's
interpreter (fp32 attention; the linears in row tiles)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, fp8_llama, llama_tensors, scheme_llama, write_checkpoint
from helpers import run_arrivals

from fp8route import SamplingParams
from fp8route.checkpoint.formats import compressed_tensors
from fp8route.engine import EngineConfig
from fp8route.engine.llm_engine import LLMEngine
from fp8route.engine.request import TokenLogprobs
from fp8route.kernels import paged_attention as kernel
from fp8route.models import LlamaConfig, LlamaForCausalLM

CONFIG = {**TINY, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}  # 32-wide heads
pytestmark = pytest.mark.skipif(kernel.TRITON_IMPORT_ERROR is not None, reason="needs triton")
interpreted = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU"),
]
Result = tuple[list[int], list[TokenLogprobs]]


def _folder(scheme: str, root: Path) -> Path:
    """The tiny model's checkpoint in an FP8 scheme: ModelOpt per tensor (static input scales), or
    llm-compressor's FP8_DYNAMIC (channel) and FP8_BLOCK (block)."""
    if scheme == "tensor":
        return write_checkpoint(
            root / scheme, fp8_llama(config=CONFIG), CONFIG, **{"hf_quant_config.json": MODELOPT_HF_QUANT}
        )
    quantization = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)  # type: ignore[arg-type]
    return write_checkpoint(
        root / scheme, scheme_llama(scheme, CONFIG), {**CONFIG, "quantization_config": quantization}
    )


def _engine(
    device: str, budget: int, prefix_caching: bool, folder: Path | None, kv: str = "auto", upstream: bool = False
) -> LLMEngine:
    """The tiny model in float (folder None) or from an FP8 folder, in the deterministic mode, its
    attention through the Triton kernels; upstream: the kernel option quantize_upstream."""
    dtype = "bfloat16" if device == "cuda" else "float32"  # the interpreter's tl.dot misreads bf16
    config = EngineConfig(
        dtype=dtype, device=device, max_num_seqs=6, max_model_len=96, num_kv_blocks=64, block_size=4,
        max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching, deterministic=True,
        skip_tokenizer_init=True, model=str(folder) if folder else None, kv_cache_dtype=kv,
        quantize_upstream=upstream,
    )  # fmt: skip
    if folder is not None:
        engine = LLMEngine.from_config(config, quiet=True)
    else:
        tensors = {n: t.to(device=device, dtype=config.torch_dtype) for n, t in llama_tensors(CONFIG).items()}
        model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), {}, tensors, batch_invariant=True)
        engine = LLMEngine(config, model, quiet=True)
    engine.runner.use_triton = True
    return engine


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    return SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True, logprobs=2)


def _run(engine: LLMEngine, prompts: Sequence[list[int]], arrivals: Sequence[tuple[int, int]]) -> list[Result]:
    return run_arrivals(engine, prompts, _params, arrivals)


@pytest.mark.parametrize(("scheme", "kv"), [("float", "auto"), ("tensor", "auto"), ("channel", "auto"),
                                           ("block", "auto"), ("float", "fp8")])  # fmt: skip
@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_tokens_and_logprobs_through_the_kernels_do_not_depend_on_the_batch(
    device: str, scheme: str, kv: str, tmp_path: Path
) -> None:
    """On a GPU the FP8 linears run the fixed-tile GEMM; on a CPU cpu_tiles. kv fp8: the e4m3 cache, its
    decode rows' keys written by the decode kernel in decode and mixed steps alike."""
    _batch_invariance(device, scheme, kv, False, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_x_quantized_by_the_norms_keeps_every_request_independent_of_its_batch(scheme: str, tmp_path: Path) -> None:
    """The same with the kernel option quantize_upstream (the norms and SiLU-up quantize x where the
    fixed tiles read it quantized; those kernels run on a GPU only)."""
    _batch_invariance("cuda", scheme, "auto", True, tmp_path)


def _batch_invariance(device: str, scheme: str, kv: str, upstream: bool, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    shared = torch.randint(0, vocab, (13,), generator=g).tolist()  # 13: a cache hit leaves one token
    prompts = [
        (shared if i % 2 else []) + torch.randint(0, vocab, (2 + 5 * i,), generator=g).tolist() for i in range(5)
    ]
    prompts.append(shared[:12] + [shared[12]])  # all but its last token cached once r1 ran: a one-token piece
    every = range(len(prompts))
    # A budget of 7 tokens chunks the longer prompts where the load around them says.
    folder = None if scheme == "float" else _folder(scheme, tmp_path)
    fresh, cached = _engine(device, 7, False, folder, kv, upstream), _engine(device, 64, True, folder, kv, upstream)
    alone = [_run(fresh, prompts, [(i, 0)])[0] for i in every]
    scenarios = {
        "together": lambda: _run(fresh, prompts, [(i, 0) for i in every]),
        "staggered": lambda: _run(fresh, prompts, [(0, 0), (2, 1), (1, 2), (5, 3), (4, 5), (3, 7)]),
        "cache warm": lambda: _run(cached, prompts, [(1, 0), *((i, 3 + i) for i in every if i != 1)]),
    }
    for name, run in scenarios.items():
        got = run()
        for i, (want, have) in enumerate(zip(alone, got, strict=True)):
            assert have == want, f"{name}: request {i} differs from its run alone"
    assert cached.blocks.stats.hit_tokens > 0
