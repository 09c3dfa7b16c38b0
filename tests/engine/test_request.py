"""A request's output logprobs: kept as columns, read back as the TokenLogprobs that went in."""

from __future__ import annotations

import gc
import pickle

import pytest

from fp8route.engine.request import OutputLogprobs, TokenLogprobs


def entries(count: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(i, -0.25 * i, i + 1, tuple(range(i % 3)), tuple(-0.5 * j for j in range(i % 3)))
            for i in range(count)]  # fmt: skip


def test_output_logprobs_read_back_what_was_appended():
    kept, added = OutputLogprobs(), entries(7)
    for entry in added:
        kept.append(entry)
    assert len(kept) == 7 and list(kept) == added and kept == added
    assert kept[0] == added[0] and kept[-1] == added[-1] and kept[2:5] == added[2:5]
    assert kept[0].top_ids == () and kept[2].top_ids == (0, 1)  # top lists of their own lengths
    with pytest.raises(IndexError):
        kept[7]
    assert pickle.loads(pickle.dumps(kept)) == added  # as outputs cross to the server's process


def test_output_logprobs_are_a_few_objects_to_the_collector_however_many_tokens():
    short, long = OutputLogprobs(), OutputLogprobs()
    short.append(entries(1)[0])
    for entry in entries(5000):
        long.append(entry)
    referents = gc.get_referents(long)
    assert len(referents) == len(gc.get_referents(short))
    assert not any(isinstance(x, tuple) for x in referents)
