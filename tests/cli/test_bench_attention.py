"""`fp8route bench attention`'s decode launches, read before any GPU work: the default by name, others
as paged_decode.Launch.parse reads them, a bad one in one line."""

from __future__ import annotations

import pytest

from fp8route.cli.bench_attention import _decode_launches
from fp8route.errors import Fp8InputError
from fp8route.kernels.paged_decode import LAUNCH, Launch


def test_the_default_launch_is_each_caches_own():
    for fp8 in (False, True):
        assert _decode_launches("default", fp8) == [LAUNCH[fp8]]
    assert _decode_launches("64x4x3, 128x4x2h", True) == [Launch(), Launch(128, 4, 2, f16=True)]
    for bad in ("", "default,12x4"):
        with pytest.raises(Fp8InputError, match="decode"):
            _decode_launches(bad, False)
