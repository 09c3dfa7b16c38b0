"""Programmatic dependent launch changes when fp8route's kernels start, never what they compute:
generate from CUDA graphs with PDL on gives the same logits, bit for bit, as with it off, over FP8
linears on the decode GEMM, the fused norms and SiLU, and the paged attention (16-bit and FP8 cache),
at batch 1 and at batches that split K and tile M; turning it on drops the captured graphs."""

from __future__ import annotations

import pytest
import torch

from fp8route.backends.kernels.pdl import set_pdl, why_not_pdl

REASON = why_not_pdl() if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"PDL: {REASON}")]
CONFIG = {  # 128-wide heads and GQA as the 8B's; widths the decode GEMM takes
    "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8,
    "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.fixture(autouse=True)
def pdl_off_after():
    yield
    set_pdl(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_pdl_gives_the_logits_plain_launches_give(tmp_path, dtype, kv_cache_dtype):
    from checkpoint_helpers import MODELOPT_HF_QUANT, fp8_llama, write_checkpoint

    from fp8route.engine import load_model
    from fp8route.linear.layer import Fp8Linear, plans_epoch

    folder = write_checkpoint(
        tmp_path / "fp8", fp8_llama(config=CONFIG), CONFIG, **{"hf_quant_config.json": MODELOPT_HF_QUANT}
    )
    model = load_model(folder, "cuda", dtype=dtype, max_batch_size=16, max_seq_len=512, kv_cache_dtype=kv_cache_dtype)
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert any(m.plan.backend_for(1, dtype).name == "fp8_gemv" for m in linears), "no layer decodes on fp8_gemv"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (16, 300), generator=g).cuda()
    for batch in (1, 5, 16):
        runs, epochs = {}, []
        for on in (False, True, False):
            set_pdl(on)
            runs.setdefault(on, []).append(model.generate(ids[:batch], 40, return_logits=True))
            epochs.append(model.runner.graphs.epoch)  # the epoch the replayed graphs were captured in
        assert epochs[0] != epochs[1] != epochs[2] and epochs[2] == plans_epoch(), "graphs were not captured again"
        (off, off_again), (on,) = runs[False], runs[True]
        assert torch.equal(off.logits, off_again.logits), "plain launches are not repeatable here"
        assert torch.equal(on.tokens, off.tokens), f"batch {batch}: tokens differ with PDL"
        assert torch.equal(on.logits, off.logits), f"batch {batch}: logits differ with PDL"
