"""The kernel options change how fp8route's kernels run, never what they compute: generate from CUDA
graphs with PDL (when kernels start) gives the same logits, bit for bit, as without, over FP8 linears
on the decode GEMM, the fused norms and SiLU, and the paged attention (16-bit and FP8 cache), at batch
1 and at batches that split K and tile M; changing an option drops the captured graphs."""

from __future__ import annotations

import pytest
import torch

from fp8route.kernels.options import kernel_options, set_kernel_options, why_not_pdl
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
    ),
]
CONFIG = {  # 128-wide heads and GQA as the 8B's; widths the decode GEMM takes
    "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8,
    "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.fixture(autouse=True)
def options_off_after():
    yield
    set_kernel_options(pdl=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_pdl_gives_the_logits_plain_launches_give(tmp_path, dtype, kv_cache_dtype):
    from checkpoint_helpers import MODELOPT_HF_QUANT, fp8_llama, write_checkpoint
    from helpers import generate_with_logits

    from fp8route.engine import load_model
    from fp8route.linear.layer import plans_epoch
    from fp8route.linear.policy import Policy

    if (reason := why_not_pdl()) is not None:
        pytest.skip(f"PDL: {reason}")
    folder = write_checkpoint(
        tmp_path / "fp8", fp8_llama(config=CONFIG), CONFIG, **{"hf_quant_config.json": MODELOPT_HF_QUANT}
    )
    model = load_model(
        folder, device="cuda", dtype=dtype, max_num_seqs=16, max_model_len=512, kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,  # each run computes its prompts again, as the first did
        policy=Policy(force="fp8_gemv"),  # every decode bucket on fp8route's decode GEMM (prefill falls back)
        pdl=False,  # the plain launches, unmeasured, until the test turns PDL on
        num_kv_blocks=2048, quiet=True,
    )  # fmt: skip
    down = model.module.model.layers[0].mlp.down_proj
    assert all(down.plan.backend_for(m, dtype).name == "fp8_gemv" for m in (1, 5, 16))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (16, 300), generator=g).cuda()
    for batch in (1, 5, 16):
        runs, epochs = {}, []
        for on in (False, True, False):
            set_kernel_options(pdl=on)
            runs.setdefault(on, []).append(generate_with_logits(model, ids[:batch], 40))
            epochs.append(model.engine.runner.graphs.epoch)  # the epoch the replayed graphs were captured in
        assert epochs[0] != epochs[1] != epochs[2] and epochs[2] == plans_epoch(), "graphs were not captured again"
        (off, off_again), (on,) = runs[False], runs[True]
        assert torch.equal(off[1], off_again[1]), "plain launches are not repeatable here"
        assert torch.equal(on[0], off[0]), f"batch {batch}: tokens differ with PDL"
        assert torch.equal(on[1], off[1]), f"batch {batch}: logits differ with PDL"


def test_pdl_left_open_is_measured_per_decode_graph_and_changes_no_logit(tmp_path):
    """EngineConfig.pdl None (the default): every decode bucket captured with PDL and without, their
    replays timed, one kept, at start; the tokens and logits those graphs give equal those of PDL off."""
    from checkpoint_helpers import MODELOPT_HF_QUANT, fp8_llama, write_checkpoint
    from helpers import generate_with_logits

    from fp8route.engine import load_model

    if (reason := why_not_pdl()) is not None:
        pytest.skip(f"PDL: {reason}")
    folder = write_checkpoint(
        tmp_path / "fp8", fp8_llama(config=CONFIG), CONFIG, **{"hf_quant_config.json": MODELOPT_HF_QUANT}
    )
    common = {"device": "cuda", "max_num_seqs": 16, "max_model_len": 512, "enable_prefix_caching": False,
              "num_kv_blocks": 2048, "quiet": True}  # fmt: skip
    ids = torch.randint(0, CONFIG["vocab_size"], (16, 300), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for pdl in (None, False):
        model = load_model(folder, pdl=pdl, **common)
        graphs = model.engine.runner.graphs
        if pdl is None:
            assert sorted(graphs.pdl_choices) == graphs.sizes, "a bucket captured without measuring PDL"
            assert all(c.off_ms > 0 and c.on_ms > 0 for c in graphs.pdl_choices.values())
            assert not kernel_options().pdl, "measuring left PDL on outside the graphs"
        else:
            assert not graphs.pdl_choices
        runs.append([generate_with_logits(model, ids[:batch], 40) for batch in (1, 5, 16)])
        del model
    for (measured, off), batch in zip(zip(*runs, strict=True), (1, 5, 16), strict=True):
        assert torch.equal(measured[0], off[0]) and torch.equal(measured[1], off[1]), f"batch {batch} differs"
