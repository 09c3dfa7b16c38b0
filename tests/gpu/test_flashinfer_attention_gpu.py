"""attention="flashinfer" against the builtin attention on one bf16 model: each step's logits against
an fp32 full forward of the tokens it produced, as close as the builtin engine's; rows of different
lengths; decode eager and from CUDA graphs; a bf16 cache and an fp8 one (scales that are not 1)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import build_lm

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs CUDA and flashinfer",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("graphs", "kv_fp8"), [(True, False), (False, False), (True, True), (False, True)])
def test_flashinfer_is_as_close_to_the_fp32_forward_as_builtin(graphs: bool, kv_fp8: bool) -> None:
    from checkpoint_helpers import TINY, llama_tensors
    from helpers import generate_with_logits

    from fp8route.engine import EngineConfig
    from fp8route.engine.kv_quant import FP8_KV, KVScales
    from fp8route.models import LlamaConfig

    # FlashInfer's kernels are built for head sizes 64, 128, 256: 4 heads of 128, 2 KV heads.
    config = {**TINY, "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    tensors = {n: t.cuda() for n, t in llama_tensors(config).items()}
    cfg = LlamaConfig.from_hf(config)
    reference = build_lm(
        cfg,
        {},
        {n: t.float() for n, t in tensors.items()},
        EngineConfig(dtype="float32", max_model_len=128, num_kv_blocks=64),
    )
    gen = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (3, 40), device="cuda", generator=gen)
    lengths, steps = [40, 11, 27], 24
    layers = cfg.num_hidden_layers
    # Per layer and unequal: a scale applied to the wrong layer, or K's to V, shows in the logits.
    k_scales, v_scales = tuple(0.01 * (i + 1) for i in range(layers)), tuple(0.004 * (i + 2) for i in range(layers))
    scales = KVScales(k_scales, v_scales, "test")
    errors = {}
    for attention in ("builtin", "flashinfer"):
        settings = EngineConfig(
            max_num_seqs=4, max_model_len=512, use_cuda_graphs=graphs, attention=attention, num_kv_blocks=256
        )
        model = build_lm(
            cfg, {}, {n: t.bfloat16() for n, t in tensors.items()}, settings, kv_scales=scales if kv_fp8 else None,
        )  # fmt: skip
        assert (model.engine.runner.pool.dtype == FP8_KV) == kv_fp8
        tokens, logits = generate_with_logits(model, ids, steps, prompt_lengths=lengths)
        worst = 0.0
        for row, n in enumerate(lengths):
            with torch.no_grad():
                full = reference(tokens[row : row + 1, : n + steps - 1])[0, n - 1 :].float()
            worst = max(worst, ((logits[row] - full).abs().max() / full.abs().max()).item())
        errors[attention] = worst
    assert errors["flashinfer"] <= 2 * errors["builtin"] + 1e-3, errors
