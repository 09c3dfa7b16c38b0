"""Tensor parallel on CPU: two gloo processes, each rank's slices, logits and greedy tokens equal to
the unsharded model's, each rank reading only its slices and planning only its local shapes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, fp8_llama, llama_tensors, scheme_llama, write_checkpoint
from safetensors import safe_open

import fp8route.checkpoint.shards as shards_module
import fp8route.linear.layer as layer_module
from fp8route import Fp8InputError, Fp8Linear, explain, load_checkpoint, sqnr_db
from fp8route.checkpoint.formats import compressed_tensors
from fp8route.engine import load_model
from fp8route.models.llama import LlamaConfig
from fp8route.models.parallel import RowParallel, Shard, Slicer, VocabParallelHead, check_divisible

HF_QUANT = "hf_quant_config.json"
PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 1, 250, 30, 2, 0]])
NEW = 5


@dataclass(frozen=True)
class Case:
    kind: str  # "fp8" or "bf16"
    kv_heads: int = 2  # 2: one KV head per rank; 1: the KV head replicated
    lm_head: str = "vocab"
    tied: bool = False
    bias: bool = False  # q/k/v, o and down biases


CASES = [
    Case("fp8", bias=True),
    Case("fp8", kv_heads=1, tied=True),
    Case("fp8", lm_head="replicated"),
    Case("bf16", bias=True),
    Case("bf16", kv_heads=1, tied=True),
    Case("bf16", lm_head="replicated"),
]


class Recording:
    """safe_open, noting the shape of every tensor read (whole or in part)."""

    reads: dict[str, tuple[int, ...]] = {}

    def __init__(self, path: str, framework: str) -> None:
        self.f = safe_open(path, framework=framework)

    def __enter__(self) -> Recording:
        self.f.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.f.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.f.get_tensor(name)
        self.reads[name] = tuple(tensor.shape)
        return tensor

    def get_slice(self, name: str) -> RecordedSlice:
        return RecordedSlice(self.f.get_slice(name), name)


class RecordedSlice:
    def __init__(self, piece, name: str) -> None:
        self.piece, self.name = piece, name

    def __getattr__(self, attr: str):
        return getattr(self.piece, attr)

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.piece[index]
        Recording.reads[self.name] = tuple(tensor.shape)
        return tensor


def run_rank(rank: int, world: int, folder: str, lm_head: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init)
    shards_module.safe_open = Recording  # type: ignore[assignment]
    planned: list[tuple[int, int]] = []
    make_plan = layer_module.make_plan

    def recording_plan(name, problem, *args, **kwargs):
        planned.append((problem.n, problem.k))
        return make_plan(name, problem, *args, **kwargs)

    layer_module.make_plan = recording_plan  # type: ignore[assignment]
    try:
        model = load_model(
            folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_model_len=16, tp_lm_head=lm_head
        )
        attn = model.module.model.layers[0].self_attn
        qkv = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
        fp8 = [m for m in model.module.modules() if isinstance(m, Fp8Linear)]
        shapes = {
            "qkv_n": (qkv.out_features if isinstance(qkv, Fp8Linear) else qkv.weight.shape[0]),
            "o_is_row_parallel": isinstance(attn.o_proj, RowParallel),
            "phases": (attn.o_proj.phase, model.module.model.layers[0].mlp.down_proj.phase),
            "head_is_vocab_parallel": isinstance(model.module.lm_head, VocabParallelHead),
            "routes": [m.plan.route_text(torch.float32) for m in fp8],
            "held": sorted((m.out_features, m.in_features) for m in fp8),
            "planned": sorted(planned),
            "reads": dict(Recording.reads),
            "explain": explain(model),
        }
        logits = model(PROMPT)
        tokens = model.generate(PROMPT, NEW)
        torch.save({"logits": logits, "tokens": tokens, **shapes}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def checkpoint(tmp_path, case: Case):
    config = {**TINY, "num_key_value_heads": case.kv_heads, "tie_word_embeddings": case.tied}
    tensors = fp8_llama(config=config, bias=case.bias) if case.kind == "fp8" else llama_tensors(config)
    if case.bias:
        g = torch.Generator().manual_seed(1)
        for name, t in list(tensors.items()):
            module, _, part = name.rpartition(".")
            leaf = module.rpartition(".")[2]
            if part == "weight" and leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"):
                tensors.setdefault(f"{module}.bias", (0.1 * torch.randn(t.shape[0], generator=g)).to(torch.bfloat16))
    extra = {HF_QUANT: MODELOPT_HF_QUANT} if case.kind == "fp8" else {}
    folder = write_checkpoint(tmp_path / case.kind, tensors, config, **extra)
    return folder, {name: tuple(t.shape) for name, t in tensors.items()}


def local_shape(name: str, shape: tuple[int, ...], case: Case) -> tuple[int, ...]:
    """What rank r of 2 reads of a tensor: written out here, not taken from the Slicer."""
    module, _, part = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    rows = {"q_proj", "gate_proj", "up_proj"} | ({"k_proj", "v_proj"} if case.kv_heads >= 2 else set())
    if case.lm_head == "vocab":
        rows.add("lm_head")
    if part in ("weight", "bias") and leaf in rows:
        return (shape[0] // 2, *shape[1:])
    if part == "weight" and leaf in ("o_proj", "down_proj"):
        return (shape[0], shape[1] // 2)
    return shape


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.kind}-kv{c.kv_heads}-{c.lm_head}"
                         + ("-tied" if c.tied else "") + ("-bias" if c.bias else ""))  # fmt: skip
def test_two_ranks_read_their_slices_and_give_the_unsharded_logits_and_tokens(tmp_path, case):
    folder, full_shapes = checkpoint(tmp_path, case)
    full = load_model(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_model_len=16)
    expected_logits, expected_tokens = full(PROMPT), full.generate(PROMPT, NEW)
    mp.start_processes(
        run_rank,
        args=(2, str(folder), case.lm_head, f"file://{tmp_path}/init", str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    hd = TINY["hidden_size"] // TINY["num_attention_heads"]
    local_q = TINY["num_attention_heads"] // 2 * hd
    for rank, r in enumerate(ranks):
        assert r["qkv_n"] == (local_q + 2 * max(1, case.kv_heads // 2) * hd if case.kind == "fp8" else local_q)
        assert r["o_is_row_parallel"] and r["phases"] == (0, 1)  # a fused all-reduce alternates by them
        assert r["head_is_vocab_parallel"] == (case.lm_head == "vocab")
        # Every tensor read once, as this rank's part: no sharded tensor is ever read whole.
        assert r["reads"] == {name: local_shape(name, shape, case) for name, shape in full_shapes.items()}
        # Planned for the local shapes alone (rank 1 rebuilds a biased o/down without its bias).
        assert set(r["planned"]) == set(r["held"])
        rebuilt = 2 * TINY["num_hidden_layers"] if case.kind == "fp8" and case.bias and rank else 0
        assert len(r["planned"]) == len(r["held"]) + rebuilt
        assert r["explain"].startswith(f"rank {rank} of 2: ")
        torch.testing.assert_close(r["logits"], expected_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(r["tokens"], expected_tokens)
    if case.kind == "fp8":
        assert f"N={local_q + 2 * max(1, case.kv_heads // 2) * hd} K={TINY['hidden_size']}" in ranks[0]["explain"]
    assert ranks[0]["routes"] == ranks[1]["routes"]


def test_the_slicer_names_each_ranks_rows_and_columns():
    cfg = LlamaConfig.from_hf(TINY)  # 4 heads of 16, 2 KV heads, intermediate 160, vocab 256
    rank1 = Slicer.of(cfg, Shard(1, 2))
    assert rank1.get("model.layers.0.self_attn.q_proj.weight") == (slice(32, 64),)
    assert rank1.get("model.layers.0.self_attn.v_proj.bias") == (slice(16, 32),)
    assert rank1.get("model.layers.1.mlp.down_proj.weight") == (slice(None), slice(80, 160))
    assert rank1.get("model.layers.1.mlp.down_proj.bias") is None
    assert rank1.get("lm_head.weight") == (slice(128, 256),)
    assert Slicer.of(cfg, Shard(1, 2), "replicated").get("lm_head.weight") is None
    for whole in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight_scale", "model.norm.weight"):
        assert rank1.get(whole) is None
    # Fewer KV heads than ranks: ranks 0-1 share KV head 0, ranks 2-3 KV head 1.
    assert Slicer.of(cfg, Shard(1, 4)).get("model.layers.0.self_attn.k_proj.weight") == (slice(0, 16),)
    assert Slicer.of(cfg, Shard(2, 4)).get("model.layers.0.self_attn.k_proj.weight") == (slice(16, 32),)


def test_sizes_that_do_not_divide_the_heads_or_the_vocabulary_are_named(tmp_path):
    cfg = LlamaConfig.from_hf(TINY)
    with pytest.raises(Fp8InputError, match="4 attention heads"):
        check_divisible(cfg, 3)
    with pytest.raises(Fp8InputError, match="KV heads"):
        check_divisible(LlamaConfig.from_hf({**TINY, "num_key_value_heads": 3, "num_attention_heads": 6}), 4)
    odd_vocab = LlamaConfig.from_hf({**TINY, "vocab_size": 255})
    with pytest.raises(Fp8InputError, match=r"vocabulary \(255 tokens\); load with tp_lm_head='replicated'"):
        Slicer.of(odd_vocab, Shard(0, 2))
    assert Slicer.of(odd_vocab, Shard(0, 2), "replicated").get("lm_head.weight") is None
    with pytest.raises(Fp8InputError, match="tp_lm_head must be one of vocab, replicated"):
        Slicer.of(cfg, Shard(0, 2), "rows")  # type: ignore[arg-type]
    with pytest.raises(Fp8InputError, match="tp_lm_head must be one of"):
        load_model(tmp_path, device="cpu", tp_lm_head="rows")  # type: ignore[arg-type]


def sample_rank(rank: int, world: int, folder: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init)
    try:
        torch.manual_seed(rank)  # each rank's own RNG differs: the sampled tokens must not
        model = load_model(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_model_len=16)
        torch.save(model.generate(PROMPT, NEW, temperature=1.0), f"{out}/sampled{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_sample_the_same_tokens_without_a_seed(tmp_path):
    folder, _ = checkpoint(tmp_path, Case("fp8"))
    mp.start_processes(
        sample_rank, args=(2, str(folder), f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    assert torch.equal(torch.load(tmp_path / "sampled0.pt"), torch.load(tmp_path / "sampled1.pt"))


# Llama dimensions whose every split over 2 ranks is whole 128x128 blocks: q 256 rows (128 a rank), one
# KV head of 128 (replicated), gate/up 512 rows and down 512 columns (256 a rank), o 256 columns.
BLOCK_TP = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 512}
# What rank r of 2 reads of each scale: column-parallel ones their rows, row-parallel channel scales whole.
SCALE_READS = {
    "channel": {"q_proj": (32, 1), "k_proj": (16, 1), "o_proj": (64, 1), "up_proj": (80, 1), "down_proj": (64, 1)},
    "block": {"q_proj": (1, 2), "k_proj": (1, 2), "o_proj": (2, 1), "up_proj": (2, 2), "down_proj": (2, 2)},
}


@pytest.mark.parametrize(("scheme", "config"), [("channel", TINY), ("block", BLOCK_TP)], ids=["channel", "block"])
def test_two_ranks_read_their_part_of_channel_and_block_scales(tmp_path, scheme, config):
    tensors = scheme_llama(scheme, config)
    qc = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)
    folder = write_checkpoint(tmp_path / scheme, tensors, {**config, "quantization_config": qc})
    full = load_model(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_model_len=16)
    expected_logits = full(PROMPT)
    mp.start_processes(
        run_rank,
        args=(2, str(folder), "vocab", f"file://{tmp_path}/init", str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        for leaf, shape in SCALE_READS[scheme].items():
            group = "mlp" if leaf in ("up_proj", "down_proj") else "self_attn"
            assert r["reads"][f"model.layers.1.{group}.{leaf}.weight_scale"] == shape, leaf
        # Not equal to the bit: the ranks' row-parallel sums differ from the whole layer's in fp32 rounding,
        # which can move an activation across an e4m3 rounding boundary in a later dynamic quantization
        # (and channel o/down quantize each rank's part of x per token with its own amax, as vLLM's do).
        # That each rank's layers compose the whole ones exactly is the next test's.
        assert sqnr_db(expected_logits, r["logits"]) >= 30


@pytest.mark.parametrize(("scheme", "config"), [("channel", TINY), ("block", BLOCK_TP)], ids=["channel", "block"])
def test_each_ranks_parts_of_a_layer_compose_the_whole_layer(tmp_path, scheme, config):
    qc = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)
    folder = write_checkpoint(tmp_path / scheme, scheme_llama(scheme, config), {**config, "quantization_config": qc})
    cfg = LlamaConfig.from_hf(config)
    whole = load_checkpoint(folder, device="cpu").linears
    ranks = [load_checkpoint(folder, device="cpu", slices=Slicer.of(cfg, Shard(r, 2))).linears for r in range(2)]
    x = torch.randn(5, config["hidden_size"])
    for leaf in ("qkv_proj", "gate_up_proj"):
        name = f"model.layers.1.{'self_attn' if leaf == 'qkv_proj' else 'mlp'}.{leaf}"
        full = whole[name](x).split(list(whole[name].logical_widths), dim=-1)
        parts = [rank[name](x).split(list(rank[name].logical_widths), dim=-1) for rank in ranks]
        for member, rows in enumerate(full):
            if parts[0][member].shape == rows.shape:  # a KV head both ranks hold
                assert all(torch.equal(p[member], rows) for p in parts)
            else:
                assert torch.equal(torch.cat([p[member] for p in parts], dim=-1), rows)
    down = "model.layers.1.mlp.down_proj"
    x = torch.randn(5, config["intermediate_size"])
    k = ranks[0][down].in_features
    summed = ranks[0][down](x[:, :k]) + ranks[1][down](x[:, k:])
    if scheme == "block":  # 1x128 input groups fall on the same columns whole or split
        torch.testing.assert_close(summed, whole[down](x), rtol=1e-5, atol=1e-5)
    else:  # each rank's x part is quantized per token with its own amax; the weight scales are whole
        assert all(torch.equal(rank[down].weight_scale, whole[down].weight_scale) for rank in ranks)
        assert sqnr_db(whole[down](x), summed) >= 25
