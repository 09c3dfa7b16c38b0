"""`fp8route bench attention`'s decode launches, read before any GPU work: the defaults by name, others
as paged_decode.Launch.parse reads them, a bad one in one line."""

from __future__ import annotations

import pytest

from fp8route.cli.bench_attention import _decode_launches
from fp8route.errors import Fp8InputError
from fp8route.kernels.paged_decode import LAUNCH, Launch


def test_the_default_launches_are_each_caches_own_and_its_fused_combine():
    for fp8 in (False, True):
        assert _decode_launches("default,default-fused", fp8) == [LAUNCH[fp8], LAUNCH[fp8]._replace(fused=True)]
    assert _decode_launches("64x4x3c, 128x4x2h", True) == [Launch(fused=True), Launch(128, 4, 2, f16=True)]
    for bad in ("", "default,12x4"):
        with pytest.raises(Fp8InputError, match="decode"):
            _decode_launches(bad, False)
