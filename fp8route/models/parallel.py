"""Tensor parallelism over the default torch.distributed group, the way the serving engines shard
a Llama-family model: q/k/v and gate/up column-parallel (each rank its query heads, its KV heads or
a replica of one when there are fewer KV heads than ranks, its slice of the intermediate size), o
and down row-parallel followed by an all-reduce; embedding, norms and lm_head replicated.

Sharding happens after the checkpoint is read and before the model is built, so every rank plans
its layers for its own local shapes (by the routing table, which `fp8route tune --tp N` fills);
per-tensor scales are shared by every slice. The all-reduces are torch.distributed collectives, so
a decode step captured in a CUDA graph captures them too (fp8route.models.collectives picks a one-shot
peer-memory all-reduce or NCCL on GPUs; gloo on CPUs, eager only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from fp8route.errors import Fp8InputError
from fp8route.linear.layer import Fp8Linear
from fp8route.models.collectives import keep_multicast_off
from fp8route.models.llama import FloatLinear, LlamaConfig


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


def local_config(cfg: LlamaConfig, size: int) -> LlamaConfig:
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        head_dim=cfg.head_size,
    )


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks by reduce
    (load_model gives every RowParallel of a model the one AllReduce it picked)."""

    def __init__(self, linear: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] = nccl_all_reduce) -> None:
        super().__init__()
        self.linear = linear
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.linear(x))


def shard_layers(
    cfg: LlamaConfig, linears: Mapping[str, nn.Module], tensors: Mapping[str, torch.Tensor], shard: Shard
) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """This rank's linears and tensors: every projection sliced, o/down wrapped in RowParallel."""
    check_divisible(cfg, shard.size)
    hd, heads, kv = cfg.head_size, cfg.num_attention_heads, cfg.num_key_value_heads
    q_rows = _block(heads * hd, shard)
    kv_rows = _kv_block(kv, hd, shard)
    inter_rows = _block(cfg.intermediate_size, shard)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": inter_rows, "up_proj": inter_rows}
    fused = {
        "qkv_proj": [(0, q_rows), (heads * hd, kv_rows), ((heads + kv) * hd, kv_rows)],
        "gate_up_proj": [(0, inter_rows), (cfg.intermediate_size, inter_rows)],
    }
    columns = {"o_proj": q_rows, "down_proj": inter_rows}
    out_linears: dict[str, nn.Module] = {}
    for name, module in linears.items():
        leaf = name.rpartition(".")[2]
        if leaf in fused:
            out_linears[name] = _rows(module, [slice(o + r.start, o + r.stop) for o, r in fused[leaf]], shard)
        elif leaf in rows:
            out_linears[name] = _rows(module, [rows[leaf]], shard)
        elif leaf in columns:
            out_linears[name] = RowParallel(_columns(module, columns[leaf], shard))
        else:
            out_linears[name] = module  # lm_head and anything else: replicated
    out_tensors = dict(tensors)
    for name, tensor in tensors.items():
        owner, _, part = name.rpartition(".")
        leaf = owner.rpartition(".")[2]
        if part not in ("weight", "bias") or owner in linears:
            continue
        if leaf in rows:
            out_tensors[name] = tensor[rows[leaf]].contiguous()
        elif leaf in columns and part == "weight":
            del out_tensors[name]
            bias = tensors.get(f"{owner}.bias")
            float_linear = FloatLinear(tensor[:, columns[leaf]].contiguous(), bias if shard.rank == 0 else None)
            out_tensors.pop(f"{owner}.bias", None)
            out_linears[owner] = RowParallel(float_linear)
    return out_linears, out_tensors


def _block(total: int, shard: Shard) -> slice:
    per = total // shard.size
    return slice(shard.rank * per, (shard.rank + 1) * per)


def _kv_block(kv_heads: int, head_dim: int, shard: Shard) -> slice:
    if kv_heads >= shard.size:
        return _block(kv_heads * head_dim, shard)
    head = shard.rank * kv_heads // shard.size  # fewer KV heads than ranks: each rank a replica of one
    return slice(head * head_dim, (head + 1) * head_dim)


def _rows(module: nn.Module, pieces: list[slice], shard: Shard) -> nn.Module:
    if isinstance(module, Fp8Linear):
        weight = torch.cat([module.weight[p] for p in pieces]).contiguous()
        bias = None if module.bias is None else torch.cat([module.bias[p] for p in pieces])
        widths = [p.stop - p.start for p in pieces]
        return Fp8Linear(weight, module.weight_scale, module.input_scale, bias, name=f"{module.name}@tp{shard.rank}",
                         logical_widths=widths, policy=module.policy, preference=module.preference)  # fmt: skip
    if isinstance(module, FloatLinear):
        bias = None if module.bias is None else torch.cat([module.bias[p] for p in pieces])
        return FloatLinear(torch.cat([module.weight[p] for p in pieces]).contiguous(), bias)
    raise Fp8InputError(f"cannot shard a {type(module).__name__}: expected an Fp8Linear or a float linear")


def _columns(module: nn.Module, piece: slice, shard: Shard) -> nn.Module:
    # The bias is added once, by rank 0, so the all-reduce sums it once.
    if isinstance(module, Fp8Linear):
        bias = module.bias if shard.rank == 0 else None
        return Fp8Linear(module.weight[:, piece].contiguous(), module.weight_scale, module.input_scale, bias,
                         name=f"{module.name}@tp{shard.rank}", policy=module.policy,
                         preference=module.preference)  # fmt: skip
    if isinstance(module, FloatLinear):
        return FloatLinear(module.weight[:, piece].contiguous(), module.bias if shard.rank == 0 else None)
    raise Fp8InputError(f"cannot shard a {type(module).__name__}: expected an Fp8Linear or a float linear")
