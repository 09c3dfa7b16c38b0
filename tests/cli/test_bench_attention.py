"""`fp8route bench attention`'s decode launches, read before any GPU work: the default by name, others
as paged_decode.Launch.parse reads them, a bad one in one line; a prefill arm that cannot run is a line."""

from __future__ import annotations

import pytest
import torch

from fp8route.bench.attention import _checked_arm
from fp8route.cli.bench_attention import _decode_launches
from fp8route.errors import Fp8InputError
from fp8route.kernels.paged_decode import Launch


def test_the_default_launch_is_the_kernels_own_choice():
    for fp8 in (False, True):
        assert _decode_launches("default", fp8) == [None]
    assert _decode_launches("64x4x3, 128x4x2h-r128", True) == [Launch(), Launch(128, 4, 2, f16=True, regs=128)]
    for bad in ("", "default,12x4"):
        with pytest.raises(Fp8InputError, match="decode"):
            _decode_launches(bad, False)


def test_a_prefill_arm_that_cannot_run_or_is_wrong_is_a_line_not_the_end(capsys):
    expected = torch.ones(4, 2, 8)

    def fails() -> None:
        raise RuntimeError("no kernel for this GPU")

    assert _checked_arm("absent", lambda: None, expected, 4) is None
    assert _checked_arm("broken", fails, expected, 4) is None
    assert _checked_arm("wrong", lambda: lambda: 2 * expected, expected, 4) is None
    good = _checked_arm("good", lambda: lambda: expected.clone(), expected, 4)
    assert good is not None and torch.equal(good(), expected)
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "broken at 4 tokens: RuntimeError: no kernel for this GPU",
        "wrong at 4 tokens: AssertionError: prefill wrong: relative error 1.00e+00 against the torch path",
    ]
