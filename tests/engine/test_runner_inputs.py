"""The model runner's step inputs, on plain data: what a SchedulerOutput's pieces become on the host
before one copy takes them to the device (positions, token ids, pending tokens, table rows, KV slots,
which tokens sample). The forward itself is tests/engine/test_mixed_step.py's and test_prefill_graphs.py's."""

from __future__ import annotations

import numpy as np

from fp8route.engine.runner import decode_inputs, padded_to, step_inputs
from fp8route.engine.scheduler_output import ScheduledSeq

BLOCK = 4


def piece(row: int, start: int, known: list[int], n: int, samples: bool = True) -> ScheduledSeq:
    """Row `row`'s piece of n positions from start, the host knowing the ids `known` of its first ones."""
    return ScheduledSeq(f"r{row}", row, start, n, known, samples, 0)


def test_a_mixed_step_is_one_flat_batch_of_its_pieces_in_order():
    blocks = {2: [5], 0: [7, 3], 1: [9, 2]}
    # A decode whose input is the token its row sampled last step, not read back yet (position 3).
    decode = piece(2, 3, [], 1)
    # A prompt's last chunk, positions 5..7: its second block is block 3.
    tail = piece(0, 5, [25, 26, 27], 3)
    # A fresh prompt's first chunk, which does not sample.
    head = piece(1, 0, [40, 41, 42, 43], 4, samples=False)
    x = step_inputs([decode, tail, head], blocks, BLOCK)
    assert x.starts.tolist() == [3, 5, 0] and x.counts.tolist() == [1, 3, 4]
    assert x.offsets.tolist() == [0, 1, 4, 8]
    assert x.positions.tolist() == [3, 5, 6, 7, 0, 1, 2, 3]
    assert x.ids.tolist() == [0, 25, 26, 27, 40, 41, 42, 43]
    assert x.pending.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert x.token_rows.tolist() == [2, 0, 0, 0, 1, 1, 1, 1]
    assert x.slots.tolist() == [5 * 4 + 3, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3]
    assert x.sample_at.tolist() == [0, 3]  # the last token of each piece that samples


def test_a_chunk_that_crosses_blocks_writes_each_position_into_its_own_block():
    x = step_inputs([piece(0, 2, list(range(2, 10)), 8)], {0: [6, 1, 8]}, BLOCK)
    assert x.slots.tolist() == [26, 27, 4, 5, 6, 7, 32, 33]
    assert x.sample_at.tolist() == [7]


def test_a_recomputed_chunk_whose_last_token_is_not_read_back_reads_it_on_the_device():
    x = step_inputs([piece(0, 0, [1, 2, 3], 4)], {0: [2]}, BLOCK)
    assert x.ids.tolist() == [1, 2, 3, 0] and x.pending.tolist() == [0, 0, 0, 1]


def test_a_decode_step_reads_each_rows_token_or_marks_it_pending():
    read = piece(3, 2, [52], 1)  # its token is on the host
    pending = piece(0, 2, [], 1)  # sampled, not read back
    assert decode_inputs([read, pending]).tolist() == [[52, 0], [0, 1], [2, 2], [3, 0]]


def test_a_mixed_steps_sampled_rows_pad_to_the_buckets_warm_up_ran():
    sizes = [1, 2, 4, 8, 32, 64, 70]
    assert padded_to(np.array([5, 9, 11]), sizes).tolist() == [5, 9, 11, 11]
    assert padded_to(np.arange(33), sizes).tolist() == [*range(33), *[32] * 31]
    assert padded_to(np.arange(70), sizes).tolist() == list(range(70))
    assert padded_to(np.array([], dtype=np.int64), sizes).tolist() == []
