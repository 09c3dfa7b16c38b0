"""Tensor parallel on CPU: two gloo processes, each rank's slices, logits and greedy tokens equal to
the unsharded model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, fp8_llama, llama_tensors, write_checkpoint

from fp8route import Fp8InputError, Fp8Linear
from fp8route.models.llama import LlamaConfig
from fp8route.models.load import load_model
from fp8route.models.parallel import RowParallel, check_divisible

HF_QUANT = "hf_quant_config.json"
PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 1, 250, 30, 2, 0]])
NEW = 5


def run_rank(rank: int, world: int, folder: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init)
    try:
        model = load_model(folder, "cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=16)
        attn = model.model.layers[0].self_attn
        qkv = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
        shapes = {
            "qkv_n": (qkv.out_features if isinstance(qkv, Fp8Linear) else qkv.weight.shape[0]),
            "o_is_row_parallel": isinstance(attn.o_proj, RowParallel),
            "routes": [m.plan.route_text(torch.float32) for m in model.modules() if isinstance(m, Fp8Linear)],
        }
        logits = model(PROMPT)
        tokens = model.generate(PROMPT, NEW)
        torch.save({"logits": logits, "tokens": tokens, **shapes}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def folders(tmp_path, kv_heads: int):
    config = {**TINY, "num_key_value_heads": kv_heads}
    fp8 = write_checkpoint(tmp_path / "fp8", fp8_llama(config=config), config, **{HF_QUANT: MODELOPT_HF_QUANT})
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors(config), config)
    return {"fp8": fp8, "bf16": bf16}


@pytest.mark.parametrize("kv_heads", [2, 1])  # 2: one KV head per rank; 1: the KV head replicated
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_two_ranks_give_the_unsharded_logits_and_tokens(tmp_path, kv_heads, kind):
    folder = folders(tmp_path, kv_heads)[kind]
    full = load_model(folder, "cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=16)
    expected_logits, expected_tokens = full(PROMPT), full.generate(PROMPT, NEW)
    mp.start_processes(
        run_rank, args=(2, str(folder), f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    hd = TINY["hidden_size"] // TINY["num_attention_heads"]
    local_q = TINY["num_attention_heads"] // 2 * hd
    for r in ranks:
        if kind == "fp8":
            assert r["qkv_n"] == local_q + 2 * max(1, kv_heads // 2) * hd
        else:
            assert r["qkv_n"] == local_q
        assert r["o_is_row_parallel"]
        torch.testing.assert_close(r["logits"], expected_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(r["tokens"], expected_tokens)
    assert ranks[0]["routes"] == ranks[1]["routes"]


def test_sizes_that_do_not_divide_the_heads_are_named():
    cfg = LlamaConfig.from_hf(TINY)
    with pytest.raises(Fp8InputError, match="4 attention heads"):
        check_divisible(cfg, 3)
    with pytest.raises(Fp8InputError, match="KV heads"):
        check_divisible(LlamaConfig.from_hf({**TINY, "num_key_value_heads": 3, "num_attention_heads": 6}), 4)
