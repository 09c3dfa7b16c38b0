"""generate: a static batch of token-id rows continued by the engine, as a policy over LLMEngine.

Its rows run as requests of the engine: the same scheduler, KV pool, steps and sampler as
`LLM.generate` and the server, so the same seed gives the same tokens either way, and a batch larger
than the engine's max_num_seqs, or than its pool holds at once, queues (or is preempted and
recomputed) instead of failing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fp8route.engine.llm_engine import LLMEngine
from fp8route.engine.request import Request
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.models.token_ids import check_token_ids


@torch.no_grad()
def generate(
    engine: LLMEngine,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    on_token: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Continue each row of input_ids [B, T] by up to max_new_tokens tokens -> [B, T + max_new_tokens].

    Rows of different lengths: right-pad them to T and pass prompt_lengths (row b's prompt is
    input_ids[b, :prompt_lengths[b]]); its new tokens start at prompt_lengths[b]. temperature 0
    is greedy; otherwise tokens are sampled from the top_p nucleus, each row from the stream of
    `seed` (as SamplingParams(seed=seed) samples). A row stops after emitting an id in eos_token_id
    (the model's own EOS does not stop it). on_token(step, tokens [B]) sees each engine step's new
    tokens on the host (pad for rows that got none)."""
    batch, width = check_token_ids("generate", input_ids, engine.model.cfg.vocab_size)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise Fp8InputError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    eos = _eos_ids(eos_token_id)
    params = SamplingParams(
        max_tokens=max(max_new_tokens, 1), temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=tuple(eos),
        ignore_eos=True,
    )  # fmt: skip
    lengths = _prompt_lengths(prompt_lengths, batch, width)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    rows = input_ids.tolist()
    prompts = [rows[b][:n] for b, n in enumerate(lengths)]
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens > 0:
        requests = _submit_rows(engine, prompts, params)
        _run_rows(engine, requests, pad, on_token)
        outputs = [r.output_token_ids for r in requests]
    total = width + max_new_tokens
    filled = [ids + new + [pad] * (total - len(ids) - len(new)) for ids, new in zip(prompts, outputs, strict=True)]
    return torch.tensor(filled, dtype=torch.int64).to(input_ids.device)


def _submit_rows(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """generate's rows as requests of an idle engine, every row checked before any is queued."""
    if engine.has_unfinished:
        raise Fp8InputError("generate: the model's engine is serving other requests; wait for them to finish")
    for i, ids in enumerate(prompts):
        try:
            engine.check_prompt(ids, params)
        except Fp8InputError as e:
            raise Fp8InputError(f"generate: row {i}: {e}") from None
    return [engine.add_request(ids, params, request_id=f"generate-{i}") for i, ids in enumerate(prompts)]


def _run_rows(
    engine: LLMEngine, requests: list[Request], pad: int, on_token: Callable[[int, torch.Tensor], None] | None
) -> None:
    """Step the engine until every request is done (each keeps its own tokens); on_token sees each step's
    new ones. Anything raised, an interrupt included, aborts the rows and drains the engine."""
    row_of = {r.request_id: b for b, r in enumerate(requests)}
    step = 0
    try:
        while engine.has_unfinished:
            updates = engine.step()
            if on_token is None or not any(u.new_token_ids for u in updates):
                continue
            news = [pad] * len(requests)
            for update in updates:
                if update.new_token_ids:
                    news[row_of[update.request.request_id]] = update.new_token_ids[-1]
            on_token(step, torch.tensor(news, dtype=torch.int64))
            step += 1
    except BaseException:
        for request in requests:
            engine.abort(request.request_id)
        engine.drain()
        raise


def _prompt_lengths(lengths: Sequence[int] | torch.Tensor | None, batch: int, width: int) -> list[int]:
    if lengths is None:
        return [width] * batch
    values = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(values) != batch or any(not 1 <= n <= width for n in values):
        raise Fp8InputError(
            f"generate: prompt_lengths must give each of the {batch} rows a length in 1..{width} "
            f"(the width of input_ids), got {values}"
        )
    return values


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
