"""The KL-budget sensitivity pass of `fp8route quantize --kl-budget X`.

The linears are ranked by their calibration output error (largest first, as --keep-float ranks
them); the pass keeps the shortest prefix of that ranking in bf16 whose model, run for real on
the calibration batch (FP8 linears as load_checkpoint builds them, q/k/v and gate/up fused),
gives a mean KL(bf16 || fp8) of next-token distributions within the budget. Each trial is one
forward pass of the whole model, one decoder layer at a time as calibration runs; a binary
search over the prefix length bounds them to 2 + ceil(log2(n - 1)) for n linears.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp8route.checkpoint.layout import FUSIONS
from fp8route.checkpoint.observer import ScaleChoice
from fp8route.errors import Fp8InputError
from fp8route.linear.layer import Fp8Linear
from fp8route.models.llama import DecoderLayer, FloatLinear, LlamaConfig, Parts, RMSNorm, rope_tables
from fp8route.progress import Progress
from fp8route.quant import quantize_per_tensor

KL_MEASURE = (
    "mean over calibration positions of KL(bf16 || fp8) of the next-token distributions, the model run with "
    "the kept linears in bf16 and the rest as the FP8 layers written (activations in fp32)"
)
_ROWS = 256  # positions per log-softmax: bounds the [rows, vocab] temporaries


@dataclass(frozen=True)
class Trial:
    kept: int  # how many of the ranked linears stayed in bf16
    kl: float


@dataclass
class KlSearch:
    budget: float
    kept: list[str]
    kl: float
    trials: list[Trial] = field(default_factory=list)

    def record(self, tokens: int) -> dict[str, Any]:
        """What config.json's quantization_config.fp8route says about the pass."""
        return {
            "budget": self.budget,
            "achieved_kl": self.kl,
            "kept": list(self.kept),
            "tokens": tokens,
            "measure": KL_MEASURE,
            "search": "binary search over prefixes of the sensitivity ranking",
            "trials": [{"kept": t.kept, "kl": t.kl} for t in self.trials],
        }


def check_budget(budget: float | None) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        raise Fp8InputError(f"kl_budget must be a finite KL in nats >= 0, got {budget!r}")


def max_trials(candidates: int) -> int:
    return 1 if candidates <= 1 else 2 + math.ceil(math.log2(max(candidates - 1, 1)))


def search_budget(
    ranked: Sequence[str], budget: float, measure: Callable[[int], float], progress: Progress | None = None
) -> KlSearch:
    """The shortest prefix of `ranked` to keep in bf16 whose measured KL is <= budget.

    measure(k) is the model's KL with ranked[:k] kept. Only a measured prefix is ever chosen; the
    search assumes KL falls as more linears are kept (where it does not, the prefix found is a
    boundary between a measured failure and a measured success, not necessarily the shortest)."""
    n = len(ranked)
    bound = max_trials(n)
    trials: list[Trial] = []

    def trial(k: int) -> float:
        kl = float(measure(k))
        trials.append(Trial(k, kl))
        if progress is not None:
            progress(len(trials), bound, f"KL trial {len(trials)}: {k} kept in bf16, KL {kl:.5f}")
        return kl

    kl = trial(0)
    if kl <= budget:
        return KlSearch(budget, [], kl, trials)
    if n <= 1:
        raise Fp8InputError(
            f"kl_budget={budget} cannot be met with any linear in FP8: the one quantizable linear gives KL {kl:.5f}"
        )
    high, high_kl = n - 1, trial(n - 1)
    if high_kl > budget:
        raise Fp8InputError(
            f"kl_budget={budget} cannot be met with any linear in FP8: keeping {n - 1} of the {n} linears in bf16 "
            f"still gives KL {high_kl:.5f}; raise the budget"
        )
    low = 0  # measured above the budget
    while high - low > 1:
        mid = (low + high) // 2
        mid_kl = trial(mid)
        if mid_kl <= budget:
            high, high_kl = mid, mid_kl
        else:
            low = mid
    return KlSearch(budget, list(ranked[:high]), high_kl, trials)


class TrialModel:
    """The model on the calibration sequences with a chosen set of linears in FP8, scored against
    the float model's final hidden states (the reference calibration computed)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        load_layer: Callable[[int], dict[str, torch.Tensor]],
        embed: torch.Tensor,
        final: Mapping[str, torch.Tensor],  # model.norm.weight and lm_head.weight (absent when tied)
        sequences: Sequence[torch.Tensor],
        reference: Sequence[torch.Tensor],  # float final hidden states, [1, T, hidden] per sequence
        choices: Mapping[str, ScaleChoice],
        device: torch.device,
    ) -> None:
        self.cfg, self.load_layer, self.embed, self.device = cfg, load_layer, embed, device
        self.sequences, self.reference, self.choices = sequences, reference, choices
        self.norm = RMSNorm(final["model.norm.weight"], cfg.rms_norm_eps)
        self.head_weight = final.get("lm_head.weight", embed)
        self.float_head = FloatLinear(self.head_weight)

    def kl(self, kept: set[str]) -> float:
        """Mean KL(float || trial) per position with the linears in `kept` left in float."""
        fp8 = {n: c for n, c in self.choices.items() if n not in kept}
        hidden = [self.embed[s.to(self.device)].float()[None] for s in self.sequences]
        for i in range(self.cfg.num_hidden_layers):
            tensors = self.load_layer(i)
            layer = DecoderLayer(self.cfg, Parts(fp8_linears(tensors, fp8), tensors), f"model.layers.{i}")
            with torch.no_grad():
                hidden = [
                    layer(h, *rope_tables(self.cfg, torch.arange(h.shape[1], device=self.device))) for h in hidden
                ]
            del layer, tensors
        head: nn.Module = self.float_head
        if "lm_head" in fp8:
            head = fp8_linears({"lm_head.weight": self.head_weight}, fp8)["lm_head"]
        total, count = 0.0, 0
        with torch.no_grad():
            for h, ref in zip(hidden, self.reference, strict=True):
                for start in range(0, h.shape[1], _ROWS):
                    p = self.float_head(self.norm(ref[0, start : start + _ROWS])).float().log_softmax(-1)
                    q = head(self.norm(h[0, start : start + _ROWS])).float().log_softmax(-1)
                    total += float((p.exp() * (p - q)).sum(-1).double().sum())
                    count += p.shape[0]
        return total / max(count, 1)


def fp8_linears(tensors: Mapping[str, torch.Tensor], choices: Mapping[str, ScaleChoice]) -> dict[str, nn.Module]:
    """The Fp8Linears of the linears in `choices` whose weights are in `tensors`, built as the
    written checkpoint loads (fuse=True): weights quantized per tensor at amax/448, the calibrated
    input scale, and q/k/v or gate/up fused when all members are FP8 with one input width."""
    parts: dict[str, tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]] = {}
    for name, choice in choices.items():
        weight = tensors.get(f"{name}.weight")
        if weight is not None:
            qweight, scale = quantize_per_tensor(weight.float())
            parts[name] = (qweight, scale.float(), choice.scale, tensors.get(f"{name}.bias"))
    linears: dict[str, nn.Module] = {}
    for name in list(parts):
        parent, _, leaf = name.rpartition(".")
        for fused_leaf, members in FUSIONS:
            names = [f"{parent}.{m}" if parent else m for m in members]
            if leaf != members[0] or not all(n in parts for n in names):
                continue
            if len({parts[n][0].shape[1] for n in names}) != 1:
                continue
            group = [parts.pop(n) for n in names]
            fused = f"{parent}.{fused_leaf}" if parent else fused_leaf
            # A bias on some members only is padded with zeros, as load_checkpoint does.
            present = [b for *_, b in group if b is not None]
            bias = None
            if present:
                bias = torch.cat([present[0].new_zeros(q.shape[0]) if b is None else b for q, _, _, b in group])
            linears[fused] = Fp8Linear.from_quantized(
                torch.cat([q for q, *_ in group]),
                [s for _, s, _, _ in group],
                [float(i) for _, _, i, _ in group],
                bias,
                logical_widths=[q.shape[0] for q, *_ in group],
                name=fused,
            )
    for name, (qweight, scale, input_scale, bias) in parts.items():
        linears[name] = Fp8Linear(qweight, scale, input_scale, bias, name=name)
    return linears
