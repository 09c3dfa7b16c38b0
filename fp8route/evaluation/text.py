"""Next-token agreement on a plain text file (`fp8route eval --text FILE`): every position of the
text, not only the scored continuations of a task.

The file is read and packed as `--calib-text` packs calibration text (documents separated by
blank lines, each tokenized on its own, concatenated, cut into sequences of seq_len tokens), so
held-out text is measured on the same footing as the text the input scales were chosen on. Every
model runs on the same padded batches; at every position the first model is the reference: its
next-token log-probability of the true token, KL(reference || model) and whether their top-1
tokens agree. Positions within a sequence are correlated, so intervals treat sequences as the
units (a ratio estimator's 95% interval: token-weighted means, variance over sequences).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8route.checkpoint.calibration import read_text, text_token_ids
from fp8route.errors import Fp8InputError
from fp8route.evaluation.compare import Z95

Model = Callable[[torch.Tensor], torch.Tensor]
Progress = Callable[[int, int, str], None]


def text_sequences(path: str | os.PathLike[str], tokenizer: Any, seq_len: int, limit: int | None) -> list[torch.Tensor]:
    """The text's token ids in sequences of seq_len (the last may be shorter), the first `limit`."""
    if limit is not None and limit < 1:
        raise Fp8InputError(f"--limit must be at least 1, got {limit}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise Fp8InputError(f"--text-seq-len must be at least 2 tokens, got {seq_len!r}")
    sequences = text_token_ids(read_text(path, "--text"), tokenizer, seq_len, max_tokens=2**62)
    sequences = [s for s in sequences if s.numel() >= 2]  # one token predicts nothing
    if not sequences:
        raise Fp8InputError(f"text {path}: fewer than 2 tokens, nothing to predict")
    return sequences[:limit]


@dataclass
class TextScores:
    """Per model (rows) and sequence (columns) sums over its predicted positions."""

    nll: torch.Tensor  # [M, S] -sum log P(true next token)
    correct: torch.Tensor  # [M, S] positions whose top-1 token is the true next token
    kl: torch.Tensor  # [M, S] sum KL(reference || model); row 0 is zeros
    top1: torch.Tensor  # [M, S] positions where the model's top-1 is the reference's; row 0 counts all
    tokens: torch.Tensor  # [S] predicted positions


def score_text(
    models: Sequence[Model],
    sequences: Sequence[torch.Tensor],
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    progress: Progress | None = None,
) -> TextScores:
    if batch_size < 1:
        raise Fp8InputError(f"--batch-size must be at least 1, got {batch_size}")
    m, s = len(models), len(sequences)
    zeros = [torch.zeros(m, s, dtype=torch.float64) for _ in range(4)]
    tokens = torch.tensor([len(q) - 1 for q in sequences], dtype=torch.float64)
    scores = TextScores(zeros[0], zeros[1], zeros[2], zeros[3], tokens)
    device = torch.device(device)
    for start in range(0, s, batch_size):
        rows = list(range(start, min(start + batch_size, s)))
        width = max(len(sequences[r]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, r in enumerate(rows):
            ids[b, : len(sequences[r])] = sequences[r]
        ids = ids.to(device)
        reference: list[torch.Tensor] = []
        for k, model in enumerate(models):
            with torch.inference_mode():
                logits = model(ids)
                for b, r in enumerate(rows):
                    n = len(sequences[r]) - 1  # right padding follows every real position: it changes none
                    logp = logits[b, :n].float().log_softmax(-1)
                    target = ids[b, 1 : n + 1]
                    scores.nll[k, r] = -float(logp.gather(1, target[:, None]).double().sum())
                    scores.correct[k, r] = float((logp.argmax(-1) == target).sum())
                    if k == 0:
                        reference.append(logp)
                        scores.top1[k, r] = n
                        continue
                    ref = reference[b]
                    scores.kl[k, r] = float((ref.exp() * (ref - logp)).sum(-1).double().sum())
                    scores.top1[k, r] = float((ref.argmax(-1) == logp.argmax(-1)).sum())
                del logits
        if progress is not None:
            progress(rows[-1] + 1, s, f"{len(rows)} x {width} tokens")
    return scores


def ratio_interval(sums: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """sum(sums) / sum(tokens) and its 95% interval with sequences as the sampled units."""
    n = int(sums.numel())
    total = float(tokens.sum())
    mean = float(sums.sum()) / total
    residual = sums.double() - mean * tokens.double()
    var = float((residual**2).sum()) * n / (n - 1) / total**2 if n > 1 else 0.0
    half = Z95 * math.sqrt(var)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def summarize_text(
    path: str | os.PathLike[str], seq_len: int, scores: TextScores, labels: Sequence[str]
) -> dict[str, Any]:
    """JSON-ready: each model's NLL per token and next-token accuracy; for the others, their paired
    differences from the first, top-1 agreement and mean KL(first || other); every model's sums per
    sequence (per_sequence, over sequence_tokens predicted positions)."""
    tokens = scores.tokens
    result: dict[str, Any] = {
        "task": f"text:{Path(path).name}",
        "kind": "text",
        "source": str(path),
        "seq_len": seq_len,
        "sequences": int(tokens.numel()),
        "predicted_tokens": int(tokens.sum()),
        "models": {
            label: {
                "nll_per_token": ratio_interval(scores.nll[k], tokens),
                "next_token_acc": ratio_interval(scores.correct[k], tokens),
            }
            for k, label in enumerate(labels)
        },
    }
    if len(labels) > 1:
        result["paired"] = {
            label: {
                "nll_per_token": ratio_interval(scores.nll[k] - scores.nll[0], tokens),
                "next_token_acc": ratio_interval(scores.correct[k] - scores.correct[0], tokens),
            }
            for k, label in enumerate(labels)
            if k > 0
        }
        result["agreement"] = {
            label: {"top1": ratio_interval(scores.top1[k], tokens), "mean_kl": ratio_interval(scores.kl[k], tokens)}
            for k, label in enumerate(labels)
            if k > 0
        }
    # Per sequence, so that any two models can be compared pairwise afterwards (ratio_interval of the
    # difference of their rows over sequence_tokens), as per_example does for a task.
    result["sequence_tokens"] = [int(t) for t in tokens]
    result["per_sequence"] = {
        label: {
            "nll": scores.nll[k].tolist(),
            "correct": [int(c) for c in scores.correct[k]],
            **({"kl": scores.kl[k].tolist(), "top1": [int(t) for t in scores.top1[k]]} if k else {}),
        }
        for k, label in enumerate(labels)
    }
    return result


def format_text_summary(result: dict[str, Any]) -> str:
    labels = list(result["models"])
    lines = [
        f"{result['task']}: {result['predicted_tokens']} predicted tokens in {result['sequences']} sequences "
        f"of <= {result['seq_len']}"
    ]
    for label in labels:
        nll, acc = result["models"][label]["nll_per_token"], result["models"][label]["next_token_acc"]
        lines.append(
            f"  {label}: NLL {nll['mean']:.4f} nats/token (perplexity {math.exp(nll['mean']):.2f}), "
            f"next-token accuracy {acc['mean'] * 100:.2f}%"
        )
    for label, agree in result.get("agreement", {}).items():
        top1, kl = agree["top1"], agree["mean_kl"]
        d = result["paired"][label]["nll_per_token"]
        lines.append(
            f"  {label} vs {labels[0]}: top-1 agreement {top1['mean'] * 100:.2f}% "
            f"[{top1['low'] * 100:.2f}, {top1['high'] * 100:.2f}], mean KL({labels[0]} || {label}) "
            f"{kl['mean']:.4f} [{kl['low']:.4f}, {kl['high']:.4f}] nats/token, "
            f"NLL diff {d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
        )
    return "\n".join(lines)
