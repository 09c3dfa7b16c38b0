"""bench decode, attention and idle: their options are checked before any GPU is looked for, and on a
machine without one a valid command says it needs one."""

import pytest
import torch

from fp8route.bench.attention import parse_launches
from fp8route.cli import main
from fp8route.kernels.paged_attention import Launch


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "decode", "--ms", "1,256"], "--ms: every M must be in 1..128"),
        (["bench", "decode", "--shapes", "tp1_qkv,tp8_o"], "--shapes: unknown tp8_o"),
        (["bench", "decode", "--sweep", "--cuda-core-blocks", "16x512"], "--cuda-core-blocks: '16x512'"),
        (["bench", "attention", "--sweep", "--launches", "128x64x8"], "--launches: '128x64x8'"),
        (["bench", "attention", "--layers", "0"], "--layers must be at least 1"),
        (["bench", "idle", "ckpt", "--steps", "0"], "--steps must be at least 1"),
        (["bench", "idle", "ckpt", "--batches", "64,x"], "--batches"),
        (["bench", "idle", "ckpt", "--sampling", "greedy,json"], "--sampling takes greedy, mixed"),
    ],
)
def test_bad_options_are_one_line_naming_them(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv", [["bench", "decode", "--ms", "1"], ["bench", "attention"], ["bench", "idle", "ckpt"]])
def test_without_a_gpu_a_valid_command_says_it_needs_one(argv, capsys):
    assert main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_launches_parse_as_the_kernel_tilings():
    assert parse_launches("128x64x8x2, 64x128x4x2") == [Launch(128, 64, 8, 2), Launch(64, 128, 4, 2)]
