"""Tensor parallelism over the default torch.distributed group, the way the serving engines shard
a Llama-family model: q/k/v and gate/up column-parallel (each rank its query heads, its KV heads or
a replica of one when there are fewer KV heads than ranks, its slice of the intermediate size), o
and down row-parallel followed by an all-reduce; lm_head split over the vocabulary (its logits
all-gathered) or replicated; embedding and norms replicated.

A Slicer says which rows or columns of each weight each rank owns, and the checkpoint readers read
only those parts from the safetensors files (per-tensor scales whole, shared by every slice; channel
and block scales the part that goes with the weight's, fp8route.checkpoint.sharding), so every rank
builds and plans its layers for its own local shapes only (by the routing table, which
`fp8route tune --tp N` fills). The collectives are torch.distributed ones, so a decode step
captured in a CUDA graph captures them too (fp8route.models.collectives picks a one-shot
peer-memory all-reduce or NCCL on GPUs; gloo on CPUs, eager only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from fp8route.errors import Fp8InputError
from fp8route.linear.layer import Fp8Linear
from fp8route.models.collectives import AllReduce, keep_multicast_off
from fp8route.models.llama import FloatLinear, LlamaConfig

LmHead = Literal["vocab", "replicated"]
LM_HEADS: tuple[LmHead, ...] = ("vocab", "replicated")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    @classmethod
    def current(cls) -> Shard | None:
        """This process's place in the default group, or None when it runs alone."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return cls(dist.get_rank(), dist.get_world_size())


def init_from_env(device: torch.device | str | None) -> torch.device | None:
    """Under torchrun (WORLD_SIZE > 1), join the default group (NCCL on GPUs, gloo on CPUs) and
    return this rank's device (cuda:LOCAL_RANK); otherwise None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return None
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        keep_multicast_off()
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def shared_seed(seed: int | None, device: torch.device) -> int | None:
    """The seed every rank samples with: the given one, or under tensor parallelism one drawn by
    rank 0 and broadcast (ranks that sampled apart would feed the model different tokens)."""
    if seed is not None or Shard.current() is None:
        return seed
    value = (
        torch.randint(0, 2**62, (1,), device=device)
        if dist.get_rank() == 0
        else torch.zeros(1, dtype=torch.int64, device=device)
    )
    dist.broadcast(value, src=0)
    return int(value.item())


def check_divisible(cfg: LlamaConfig, size: int) -> None:
    """Which sizes a model splits over, said before any weight is read."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (split evenly, or replicated evenly when fewer than ranks)")
    if problems:
        raise Fp8InputError(
            f"tensor parallel size {size} does not divide {', '.join(problems)}; use a size that divides the heads"
        )


def check_lm_head(lm_head: str) -> None:
    if lm_head not in LM_HEADS:
        raise Fp8InputError(f"tp_lm_head must be one of {', '.join(LM_HEADS)}, got {lm_head!r}")


def local_config(cfg: LlamaConfig, size: int) -> LlamaConfig:
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        head_dim=cfg.head_size,
    )


@dataclass(frozen=True)
class Slicer:
    """The one place that says which part of each weight a rank owns, by module leaf name: the rows
    of the column-parallel layers (weight and bias), the columns of the row-parallel ones (weight;
    their bias is added by rank 0 alone). get(name) is the index the checkpoint readers read
    (None: the whole tensor, as for norms and embeddings; a weight's scales are read for the weight's
    part, by the checkpoint readers, who know the scheme: fp8route.checkpoint.sharding)."""

    shard: Shard
    rows: dict[str, slice]  # q/k/v, gate/up; lm_head when the vocabulary is split
    columns: dict[str, slice]  # o, down

    @classmethod
    def of(cls, cfg: LlamaConfig, shard: Shard, lm_head: LmHead = "vocab") -> Slicer:
        check_divisible(cfg, shard.size)
        check_lm_head(lm_head)
        if lm_head == "vocab" and cfg.vocab_size % shard.size:
            raise Fp8InputError(
                f"tensor parallel size {shard.size} does not divide the vocabulary ({cfg.vocab_size} tokens); "
                "load with tp_lm_head='replicated'"
            )
        hd = cfg.head_size
        q, kv = _block(cfg.num_attention_heads * hd, shard), _kv_block(cfg.num_key_value_heads, hd, shard)
        inter = _block(cfg.intermediate_size, shard)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        if lm_head == "vocab":
            rows["lm_head"] = _block(cfg.vocab_size, shard)
        return cls(shard, rows, {"o_proj": q, "down_proj": inter})

    def get(self, name: str, /) -> tuple[slice, ...] | None:
        owner, _, part = name.rpartition(".")
        leaf = owner.rpartition(".")[2]
        if part in ("weight", "bias") and leaf in self.rows:
            return (self.rows[leaf],)
        if part == "weight" and leaf in self.columns:
            return (slice(None), self.columns[leaf])
        return None


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks by reduce (the
    one AllReduce load_model picked for the model). phase is its place in a decoder layer (0 for
    o_proj, 1 for down_proj), which a fused all-reduce uses to alternate its buffers call by call."""

    def __init__(self, linear: nn.Module, reduce: AllReduce, phase: int = 0) -> None:
        super().__init__()
        self.linear = linear
        self.reduce = reduce
        self.phase = phase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.linear(x))

    def add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decoder layer does with this layer's output: the sum over ranks of partial (what
        self.linear gave), plus residual, then RMSNorm; one kernel where the all-reduce fuses them."""
        return self.reduce.add_rms_norm(partial, residual, weight, eps, self.phase)


class VocabParallelHead(nn.Module):
    """lm_head over this rank's block of the vocabulary, its logits gathered from every rank into
    the full [..., vocab] (one all-gather of static shape, which a CUDA graph captures under NCCL)."""

    def __init__(self, linear: nn.Module, size: int) -> None:
        super().__init__()
        self.linear, self.size = linear, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(self.linear(x))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        rows = local.reshape(-1, local.shape[-1]).contiguous()
        parts = rows.new_empty((self.size * rows.shape[0], rows.shape[1]))
        _all_gather(parts, rows)
        # [rank, row, piece] -> [row, rank, piece]: each row's logits in vocabulary order.
        full = parts.view(self.size, *rows.shape).transpose(0, 1).reshape(rows.shape[0], -1)
        return full.reshape(*local.shape[:-1], full.shape[-1])


def wrap_layers(
    linears: Mapping[str, nn.Module],
    tensors: Mapping[str, torch.Tensor],
    slicer: Slicer,
    reduce: AllReduce,
) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """The modules a rank runs around the slices it read: o/down in RowParallel (summed by reduce), a vocabulary-split
    lm_head (a block of the embedding when tied) in VocabParallelHead; the rest as they are."""
    out_linears, out_tensors = dict(linears), dict(tensors)
    split_vocab = "lm_head" in slicer.rows
    for name in tensors:
        owner, _, part = name.rpartition(".")
        leaf = owner.rpartition(".")[2]
        wrapped = leaf in slicer.columns or (leaf == "lm_head" and split_vocab)
        if part == "weight" and wrapped and owner not in linears:
            out_linears[owner] = FloatLinear(out_tensors.pop(name), out_tensors.pop(f"{owner}.bias", None))
    embedding = tensors.get("model.embed_tokens.weight")
    if split_vocab and "lm_head" not in out_linears and embedding is not None:
        # Tied: a view of this rank's block of the replicated embedding, no copy.
        out_linears["lm_head"] = FloatLinear(embedding[slicer.rows["lm_head"]])
    for name, module in out_linears.items():
        leaf = name.rpartition(".")[2]
        if leaf in slicer.columns:
            out_linears[name] = RowParallel(_bias_once(module, slicer.shard), reduce, int(leaf == "down_proj"))
        elif leaf == "lm_head" and split_vocab:
            out_linears[name] = VocabParallelHead(module, slicer.shard.size)
    return out_linears, out_tensors


# torch 2.13 renamed all_gather_into_tensor (the old name warns); torch>=2.6 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _block(total: int, shard: Shard) -> slice:
    per = total // shard.size
    return slice(shard.rank * per, (shard.rank + 1) * per)


def _kv_block(kv_heads: int, head_dim: int, shard: Shard) -> slice:
    if kv_heads >= shard.size:
        return _block(kv_heads * head_dim, shard)
    head = shard.rank * kv_heads // shard.size  # fewer KV heads than ranks: each rank a replica of one
    return slice(head * head_dim, (head + 1) * head_dim)


def _bias_once(module: nn.Module, shard: Shard) -> nn.Module:
    """The bias of a row-parallel layer is added by rank 0 alone, so the all-reduce sums it once.
    (Llama-family o/down have none; when they do, ranks past 0 rebuild the layer without it.)"""
    if shard.rank == 0 or getattr(module, "bias", None) is None:
        return module
    if isinstance(module, Fp8Linear):
        return Fp8Linear(module.weight, module.weight_scale, module.input_scale, None, scheme=module.scheme,
                         name=module.name, policy=module.policy, preference=module.preference)  # fmt: skip
    if isinstance(module, FloatLinear):
        return FloatLinear(module.weight)
    raise Fp8InputError(f"cannot shard a {type(module).__name__}: expected an Fp8Linear or a float linear")
