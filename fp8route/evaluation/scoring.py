"""Log-likelihood scoring the way lm-evaluation-harness does it, batched, for one or more models
run in lockstep on the same token ids.

Each request is tokenized as lm-eval's `_encode_pair` does: trailing spaces of the context move to
the continuation, the pair is encoded whole and the continuation is what follows the context's own
tokens. Requests are sorted longest first and packed into right-padded batches: with causal
attention and no mask the padding comes after every real position, so it cannot change them.
When several models are given, the first is the reference: for every scored continuation token
the KL divergence of its next-token distribution from each other model's, and whether their top-1
tokens agree, are summed per request. No per-token distribution is kept between batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8route.errors import Fp8InputError
from fp8route.evaluation.tasks import Request, Task

Model = Callable[[torch.Tensor], torch.Tensor]
Progress = Callable[[int, int, str], None]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without added special tokens, from a `tokenizers.Tokenizer` or anything whose
    encode(str) returns a list of ids."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        out = tokenizer.encode(text)
    return list(out.ids if hasattr(out, "ids") else out)


def _split(request: Request) -> tuple[str, str]:
    """lm-eval's (context, continuation): trailing spaces of the context move to the continuation."""
    context, continuation = request.context, request.continuation
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    return context, continuation


def _pair(request: Request, context_ids: list[int], whole: list[int]) -> tuple[list[int], list[int]]:
    if not context_ids:
        raise Fp8InputError(f"a request has an empty context: {request.continuation[:60]!r}")
    return context_ids, whole[len(context_ids) :]


def encode_pair(tokenizer: Any, request: Request) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval splits them."""
    context, continuation = _split(request)
    return _pair(request, encode(tokenizer, context), encode(tokenizer, context + continuation))


def encode_pairs(tokenizer: Any, requests: Sequence[Request]) -> list[tuple[list[int], list[int]]]:
    """encode_pair of every request; a `tokenizers.Tokenizer` encodes them all in one parallel
    batch (tens of thousands of requests take seconds, not a minute)."""
    if not hasattr(tokenizer, "encode_batch"):
        return [encode_pair(tokenizer, r) for r in requests]
    split = [_split(r) for r in requests]
    contexts = tokenizer.encode_batch([c for c, _ in split], add_special_tokens=False)
    wholes = tokenizer.encode_batch([c + k for c, k in split], add_special_tokens=False)
    return [_pair(r, c.ids, w.ids) for r, c, w in zip(requests, contexts, wholes, strict=True)]


@dataclass
class Scores:
    """Per model (rows) and request (columns): the continuation's summed log-probability; per
    request its token count; per other model the summed KL(reference || model) and top-1 matches."""

    logprob: torch.Tensor  # [M, R] float64
    tokens: torch.Tensor  # [R] int64
    kl: torch.Tensor  # [M, R] float64; row 0 is zeros
    top1: torch.Tensor  # [M, R] int64; row 0 counts every token


def score_requests(
    models: Sequence[Model],
    tokenizer: Any,
    requests: Sequence[Request],
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    max_length: int = 2048,
    progress: Progress | None = None,
) -> Scores:
    """Score every request with every model on the same padded batches."""
    if batch_size < 1:
        raise Fp8InputError(f"--batch-size must be at least 1, got {batch_size}")
    pairs = encode_pairs(tokenizer, requests)
    for (_, cont), r in zip(pairs, requests, strict=True):
        if not cont:
            raise Fp8InputError(f"a continuation encodes to no tokens: {r.continuation!r}")
        if len(cont) > max_length:
            raise Fp8InputError(f"a continuation of {len(cont)} tokens is longer than max_length={max_length}")
    n_models, n = len(models), len(requests)
    scores = Scores(
        logprob=torch.zeros(n_models, n, dtype=torch.float64),
        tokens=torch.tensor([len(cont) for _, cont in pairs], dtype=torch.int64),
        kl=torch.zeros(n_models, n, dtype=torch.float64),
        top1=torch.zeros(n_models, n, dtype=torch.int64),
    )
    order = sorted(range(n), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    done = 0
    for start in range(0, n, batch_size):
        batch = order[start : start + batch_size]
        _score_batch(models, [pairs[i] for i in batch], batch, scores, torch.device(device), max_length)
        done += len(batch)
        if progress is not None:
            progress(done, n, f"{len(batch)} x {max(len(pairs[i][0]) + len(pairs[i][1]) for i in batch)} tokens")
    return scores


def _score_batch(
    models: Sequence[Model],
    pairs: list[tuple[list[int], list[int]]],
    rows: list[int],
    scores: Scores,
    device: torch.device,
    max_length: int,
) -> None:
    # lm-eval's window: the last max_length + 1 tokens, the last one only ever a target.
    seqs = [(ctx + cont)[-(max_length + 1) :] for ctx, cont in pairs]
    width = max(len(s) - 1 for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    where_b: list[int] = []
    where_t: list[int] = []
    targets: list[int] = []
    owner: list[int] = []
    for b, (seq, (_, cont)) in enumerate(zip(seqs, pairs, strict=True)):
        ids[b, : len(seq) - 1] = torch.tensor(seq[:-1])
        first = len(seq) - 1 - len(cont)  # the position whose output predicts the first continuation token
        where_b += [b] * len(cont)
        where_t += range(first, first + len(cont))
        targets += cont
        owner += [rows[b]] * len(cont)
    ids = ids.to(device)
    bi, ti = torch.tensor(where_b, device=device), torch.tensor(where_t, device=device)
    target = torch.tensor(targets, device=device)
    owner_t = torch.tensor(owner)
    reference: torch.Tensor | None = None
    for m, model in enumerate(models):
        with torch.inference_mode():
            logits = model(ids)
            logp = logits[bi, ti].float().log_softmax(-1)  # [tokens, vocab], only the scored positions
            del logits
            picked = logp.gather(1, target[:, None])[:, 0].double().cpu()
            scores.logprob[m].index_add_(0, owner_t, picked)
            if reference is None:
                reference = logp
                scores.top1[m].index_add_(0, owner_t, torch.ones_like(owner_t))
                continue
            kl = (reference.exp() * (reference - logp)).sum(-1).double().cpu()
            agree = (reference.argmax(-1) == logp.argmax(-1)).long().cpu()
            scores.kl[m].index_add_(0, owner_t, kl)
            scores.top1[m].index_add_(0, owner_t, agree)


def example_metrics(task: Task, logprob: torch.Tensor) -> dict[str, list[float]]:
    """Per-example values of the task's metrics from one model's per-request log-probabilities
    (requests in task order): acc and acc_norm for multiple choice, bits_per_byte otherwise.

    acc: argmax of the summed log-probabilities (ties go to the first choice, as np.argmax).
    acc_norm: argmax of the sum divided by the choice's length in characters (lm-eval's).
    bits_per_byte: -sum log2 P over the continuation's UTF-8 bytes (its leading space included).
    """
    values: dict[str, list[float]] = {}
    i = 0
    for ex in task.examples:
        lps = logprob[i : i + len(ex.requests)].tolist()
        i += len(ex.requests)
        if task.kind == "bits_per_byte":
            nbytes = len(ex.requests[0].continuation.encode("utf-8"))
            values.setdefault("bits_per_byte", []).append(-lps[0] / math.log(2) / nbytes)
            continue
        values.setdefault("acc", []).append(float(_argmax(lps) == ex.gold))
        if task.acc_norm:
            normed = [lp / max(len(c), 1) for lp, c in zip(lps, ex.choices, strict=True)]
            values.setdefault("acc_norm", []).append(float(_argmax(normed) == ex.gold))
    return values


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda k: (values[k], -k))
