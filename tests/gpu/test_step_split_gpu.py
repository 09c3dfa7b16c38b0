"""bench e2e's decode-step split on a GPU: the kernels of real graph-replayed steps recorded and sorted."""

import pytest
import torch

from fp8route.bench import step_split
from fp8route.tuning.cupti import cupti_available

pytestmark = pytest.mark.skipif(not cupti_available(), reason="needs a CUDA GPU whose kernels torch.profiler sees")


def test_a_decode_steps_kernels_are_recorded_and_sorted_by_kind(tmp_path):
    from checkpoint_helpers import TINY

    from fp8route.checkpoint.random import write_random
    from fp8route.engine import load_model

    config = {**TINY, "hidden_size": 256}
    folder = write_random(tmp_path / "m", config, fp8=True, device="cuda")
    # A pool of a fixed size, not most of a GPU other test processes share.
    settings = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_kv_blocks": 64}
    model = load_model(folder, device="cuda", quiet=True, **settings)
    ids = torch.randint(0, config["vocab_size"], (2, 24), device="cuda")
    model.generate(ids, 4)  # the kernels' first calls
    steps = step_split.measure(model.engine, ids.tolist())
    assert steps is not None and steps.split is not None and steps.wall_ms > 0
    split = steps.split
    assert split.ms["gemm"] > 0 and split.ms["attention"] > 0 and split.ms["rest"] > 0, split
    # Per layer at least qkv, o, gate_up, down and the attention: every step's kernels, not the prefill's.
    assert split.kernels >= 5 * config["num_hidden_layers"], split
    assert split.top and all(ms > 0 for _, ms in split.top)
    assert split.bubble_ms > 0 and split.stall_ms >= 0, split  # a graph's kernels leave gaps at their boundaries
    # Four prompts a 32-token budget chunks (the first decode while the last prefill) against four
    # short ones: the same decode steps, so as many GEMMs and attention kernels a step. (Not as many
    # launches in all: the chunked rows reach a new KV block on different steps, and each step that
    # gives a row a block writes the pool's table.)
    long = torch.randint(0, config["vocab_size"], (4, 60), device="cuda").tolist()
    short = [row[:8] for row in long]
    model.generate(torch.tensor(short, device="cuda"), 4)
    measured = step_split.measure(model.engine, long), step_split.measure(model.engine, short)
    assert measured[0] is not None and measured[1] is not None
    chunked, whole = measured[0].split, measured[1].split
    assert chunked is not None and whole is not None
    for kind in ("gemm", "attention"):
        assert chunked.launches[kind] == whole.launches[kind], (kind, chunked, whole)
    assert not model.engine.has_unfinished
