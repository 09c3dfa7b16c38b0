"""The model runner's step inputs, on plain data: what a SchedulerOutput's pieces become on the host
before one copy takes them to the device (positions, token ids, pending tokens, table rows, KV slots,
which tokens sample). The forward itself is tests/engine/test_mixed_step.py's and test_prefill_graphs.py's."""

from __future__ import annotations

from fp8route.engine.request import Request, RequestMetrics
from fp8route.engine.runner import decode_inputs, step_inputs
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.scheduler import ScheduledSeq

BLOCK = 4


def request(tokens: list[int], row: int, blocks: list[int]) -> Request:
    r = Request(f"r{row}", tokens, SamplingParams(max_tokens=4), 0, RequestMetrics(0.0))
    r.row, r.blocks = row, blocks
    return r


def test_a_mixed_step_is_one_flat_batch_of_its_pieces_in_order():
    # A decode whose input is the token its row sampled last step, not read back yet (position 3).
    decode = ScheduledSeq(request([11, 12, 13], row=2, blocks=[5]), 3, 1, True, 0)
    # A prompt's last chunk, positions 5..7: its second block is block 3.
    tail = ScheduledSeq(request(list(range(20, 28)), row=0, blocks=[7, 3]), 5, 3, True, 0)
    # A fresh prompt's first chunk, which does not sample.
    head = ScheduledSeq(request([40, 41, 42, 43, 44], row=1, blocks=[9, 2]), 0, 4, False, 0)
    x = step_inputs([decode, tail, head], BLOCK)
    assert x.starts.tolist() == [3, 5, 0] and x.counts.tolist() == [1, 3, 4]
    assert x.offsets.tolist() == [0, 1, 4, 8]
    assert x.positions.tolist() == [3, 5, 6, 7, 0, 1, 2, 3]
    assert x.ids.tolist() == [0, 25, 26, 27, 40, 41, 42, 43]
    assert x.pending.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert x.token_rows.tolist() == [2, 0, 0, 0, 1, 1, 1, 1]
    assert x.slots.tolist() == [5 * 4 + 3, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3]
    assert x.sample_at.tolist() == [0, 3]  # the last token of each piece that samples


def test_a_chunk_that_crosses_blocks_writes_each_position_into_its_own_block():
    piece = ScheduledSeq(request(list(range(10)), row=0, blocks=[6, 1, 8]), 2, 8, True, 0)
    x = step_inputs([piece], BLOCK)
    assert x.slots.tolist() == [26, 27, 4, 5, 6, 7, 32, 33]
    assert x.sample_at.tolist() == [7]


def test_a_decode_step_reads_each_rows_token_or_marks_it_pending():
    read = ScheduledSeq(request([50, 51, 52], row=3, blocks=[4]), 2, 1, True, 0)  # its token is on the host
    pending = ScheduledSeq(request([60, 61], row=0, blocks=[1]), 2, 1, True, 0)  # sampled, not read back
    assert decode_inputs([read, pending]).tolist() == [[52, 0], [0, 1], [2, 2], [3, 0]]
