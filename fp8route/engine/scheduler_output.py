"""What the scheduler hands the model runner for one step: plain data, requests named by id.

The runner keeps what it needs of a request for as long as it holds a table row (NewRequest, sent
once when the row is given), and each step brings only the pieces to compute and the blocks added
to running rows. Nothing here is a live Request: the runner never reads or writes the scheduler's
state (vLLM v1's NewRequestData / CachedRequestData split).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fp8route.engine.sampling import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request given a table row this step (admitted, or readmitted after a preemption): its row's
    whole block table, and what sampling and scoring it read while it holds the row."""

    request_id: str
    row: int
    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # its output so far (a readmitted request's): penalties count it
    block_ids: Sequence[int]

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains its output."""
        return self.params.structured_outputs is not None


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's piece of a step: positions start .. start + num_tokens - 1 of table row `row`.
    token_ids: the ids of those positions the host knows, in order; the positions past them read
    their token on the device (the row's last sampled one, not read back yet). samples: the last
    position's logits choose output token number `output_index` (0 for the first). generation: the
    request's preemptions when scheduled (a step launched before a preemption must not register
    blocks the request no longer holds)."""

    request_id: str
    row: int
    start: int
    num_tokens: int
    token_ids: Sequence[int]
    samples: bool
    generation: int
    output_index: int = 0

    @property
    def pending(self) -> int:
        """How many of its positions read their token on the device."""
        return self.num_tokens - len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one step runs: the one-token pieces first (decodes), then the chunks, fresh ones last; the
    rows given this step (new_requests) and the blocks appended to running rows (row, column, block),
    for the runner to take in before the step; the requests preempted while it was scheduled."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    new_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # How many leading pieces are decode rows (attention's one-query grid); None: every leading one-token
    # piece. The deterministic mode sets it, sending a prompt's one-token piece where its other pieces go.
    decode_rows: int | None = None

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def singles(self) -> int:
        """How many pieces lead with one token each, as decode rows."""
        if self.decode_rows is not None:
            return self.decode_rows
        return next((i for i, s in enumerate(self.seqs) if s.num_tokens > 1), len(self.seqs))
