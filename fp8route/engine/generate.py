"""generate: a static batch of right-padded prompts -> chunked prefill -> one decode step per new
token, greedy or sampled, over the same runner, pool and decode graphs the serving engine uses.

Row b takes table row b and, for the call's life, the blocks its prompt plus max_new_tokens need.
The decode loop keeps everything per step on the device: next tokens, finished rows and the
output are updated with tensor ops, and the host learns nothing it has to wait for except, when
an EOS id is given, whether every row has finished (one sync every eos_check_every steps). Each
row's new tokens follow its own prompt; what comes after a row's last token is pad.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch

from fp8route.engine.argmax import greedy_tokens
from fp8route.engine.blocks import BlockManager
from fp8route.engine.kv_pool import KVPool, blocks_for
from fp8route.engine.runner import ModelRunner
from fp8route.errors import Fp8InputError
from fp8route.models.llama import LlamaConfig
from fp8route.models.parallel import shared_seed
from fp8route.models.token_ids import check_token_ids


class CausalLM(Protocol):
    """What generate needs of a model (fp8route.engine.CausalLM is one)."""

    cfg: LlamaConfig
    runner: ModelRunner
    blocks: BlockManager
    max_prefill_tokens: int

    @property
    def pool(self) -> KVPool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def plans_on_host(self) -> bool: ...

    def check_request(self, batch: int, prompt_lengths: Sequence[int], max_new_tokens: int) -> None: ...

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor | None = None,
        limit: int | None = None,
        host_lengths: Sequence[int] | None = None,
        host_blocks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, T + max_new_tokens] int64
    logits: torch.Tensor  # [B, steps run, vocab] fp32: the logits each new token was chosen from


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), limited to the top_p nucleus.

    Drawn as argmax(p / E) with E ~ Exp(1) (the exponential race, equivalent to sampling from p)
    rather than torch.multinomial, so no op here waits on the host."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class Rows:
    """Table rows 0..B-1 and the blocks for these many tokens each, taken from the model's block
    manager for a `with` block and given back at its end."""

    def __init__(self, model: CausalLM, tokens: Sequence[int]) -> None:
        self.model, self.tokens = model, list(tokens)
        self.blocks: list[list[int]] = []

    def __enter__(self) -> list[list[int]]:
        page = self.model.pool.block_size
        for n in self.tokens:
            taken = self.model.blocks.allocate(blocks_for(n, page))
            if taken is None:
                self.__exit__(None, None, None)
                raise Fp8InputError(
                    f"generate: the KV cache has {self.model.blocks.free_blocks} free blocks of {page} tokens, too "
                    f"few for {len(self.tokens)} rows of up to {max(self.tokens)} tokens; load the model with a "
                    "larger max_batch_size or max_seq_len, or free the engine using it"
                )
            self.blocks.append(taken)
        self.model.pool.set_rows(list(range(len(self.blocks))), self.blocks)
        return self.blocks

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        for taken in self.blocks:
            self.model.blocks.free(taken)
        self.blocks = []


def prefill_rows(
    model: CausalLM, input_ids: torch.Tensor, lengths: Sequence[int], blocks: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Row b's first lengths[b] tokens into its blocks (table row b), in forwards of at most
    model.max_prefill_tokens tokens (a row longer than that spans several); the logits [B, vocab]
    of each row's last token."""
    prompts = [row[:n] for row, n in zip(input_ids.tolist(), lengths, strict=True)]
    budget = model.max_prefill_tokens
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    chunk: list[tuple[int, int, int]] = []  # (row, start, length)
    used = 0

    def run() -> None:
        nonlocal chunk, used
        tokens = [prompts[r][s : s + n] for r, s, n in chunk]
        ending = [i for i, (r, s, n) in enumerate(chunk) if s + n == lengths[r]]
        out = model.runner.prefill(
            tokens, [s for _, s, _ in chunk], [r for r, _, _ in chunk], [blocks[r] for r, _, _ in chunk], ending
        )
        for i, row_logits in zip(ending, out, strict=True):
            logits[chunk[i][0]] = row_logits
        chunk, used = [], 0

    for row, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(n - start, budget - used)
            chunk.append((row, start, take))
            used += take
            start += take
            if used == budget:
                run()
    if chunk:
        run()
    return torch.stack([t for t in logits if t is not None])


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


def generate(
    model: CausalLM,
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
    eos_check_every: int = 1,
    return_logits: bool = False,
) -> torch.Tensor | Generation:
    """Continue each row of input_ids [B, T] by up to max_new_tokens tokens -> [B, T + max_new_tokens].

    Rows of different lengths: right-pad them to T and pass prompt_lengths (row b's prompt is
    input_ids[b, :prompt_lengths[b]]); its new tokens start at prompt_lengths[b]. temperature 0
    is greedy (deterministic); otherwise tokens are sampled from the top_p nucleus, reproducibly
    when a seed is given. A row stops after emitting an id in eos_token_id; the call stops when
    every row has. on_token(step, tokens [B]) sees each step's tokens as a device tensor (pad for
    finished rows); reading it on the host is a sync the caller chooses to pay. return_logits
    gives a Generation with the logits of every step as well.
    """
    batch, width = check_token_ids("generate", input_ids, model.cfg.vocab_size)
    if max_new_tokens < 0:
        raise Fp8InputError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise Fp8InputError(
            f"generate: need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}"
        )
    if eos_check_every < 1:
        raise Fp8InputError(f"generate: eos_check_every must be >= 1, got {eos_check_every}")
    lengths_list = _prompt_lengths(prompt_lengths, batch, width)
    model.check_request(batch, lengths_list, max_new_tokens)
    vocab = model.cfg.vocab_size
    eos = _eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)

    device = model.device
    ids = input_ids.to(device=device, dtype=torch.int64)
    lengths = torch.tensor(lengths_list, device=device)
    real = torch.arange(width, device=device)[None, :] < lengths[:, None]
    out = torch.full((batch, width + max_new_tokens), pad, dtype=torch.int64, device=device)
    out[:, :width] = torch.where(real, ids, pad)
    if max_new_tokens == 0:
        return Generation(out, torch.empty(batch, 0, vocab)) if return_logits else out

    generator = None
    if temperature > 0:
        seed = shared_seed(seed, device)
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
    eos_ids = torch.tensor(eos, device=device) if eos else None
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    kept: list[torch.Tensor] = []
    rows = torch.arange(batch, device=device)
    longest = max(lengths_list)

    with Rows(model, [n + max_new_tokens for n in lengths_list]) as blocks:
        logits = prefill_rows(model, input_ids, lengths_list, blocks)
        greedy = tokens = greedy_tokens(logits)
        positions = lengths.clone()  # where the token fed to the next step goes
        for step in range(max_new_tokens):
            if step > 0:
                host = [n + step for n in lengths_list] if model.plans_on_host else None
                logits, greedy = model.step(
                    tokens,
                    positions,
                    rows,
                    limit=longest + step,
                    host_lengths=host,
                    host_blocks=blocks if host else None,
                )
                positions += 1
            chosen = greedy if temperature == 0 else sample(logits, temperature, top_p, generator)
            tokens = torch.where(done, pad, chosen)
            out.scatter_(1, (lengths + step)[:, None], tokens[:, None])
            if return_logits:
                kept.append(logits.float().clone())
            if on_token is not None:
                on_token(step, tokens)
            if eos_ids is not None:
                done |= torch.isin(tokens, eos_ids)
                if (step + 1) % eos_check_every == 0 and bool(done.all()):
                    break
    if return_logits:
        return Generation(out, torch.stack(kept, dim=1))
    return out
