"""The paged decode kernel's rules without a GPU: which calls fuse the new token's write, and how a
launch configuration is named. Its numerics: test_paged_decode_interpreted.py and _gpu.py."""

from __future__ import annotations

import pytest
import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.paged_decode import LAUNCH, Launch, NewToken, fuses_new_token


def test_the_attention_kernel_takes_the_engines_new_token_and_refuses_other_shapes():
    b, h, hkv, d = 3, 8, 2, 64
    qkv = torch.zeros(b, 1, (h + 2 * hkv) * d)  # as the projection gives it: q, k, v strided views
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    cos = sin = torch.zeros(b, 1, d)
    assert fuses_new_token(q[:, 0], NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]))  # what attend passes
    assert not fuses_new_token(q[:, 0], NewToken(k[:, 0], v[:, 0], cos[0], sin[0]))  # tables not per row
    assert not fuses_new_token(q[:, 0], NewToken(k[:2, 0], v[:2, 0], cos[:, 0], sin[:, 0]))  # rows differ
    q80 = torch.zeros(b, h, 80)  # a head size that is not a power of two: RoPE and the write stay apart
    assert not fuses_new_token(
        q80, NewToken(torch.zeros(b, hkv, 80), torch.zeros(b, hkv, 80), *[torch.zeros(b, 80)] * 2)
    )


def test_a_decode_launch_is_named_as_benchmarks_write_it_and_a_bad_name_is_one_line():
    assert Launch.parse("128x4x2h") == Launch(128, 4, 2, f16=True)
    assert Launch.parse(str(LAUNCH[True])) == LAUNCH[True] and str(Launch()) == "64x4x3"
    capped = Launch(64, 4, 3, f16=True, regs=128)
    assert Launch.parse("64x4x3h-r128") == capped and str(capped) == "64x4x3h-r128"
    assert capped.options() == {"maxnreg": 128} and Launch().options() == {}
    gathered = Launch(64, 4, 3, f16=True, regs=128, table=True)
    assert Launch.parse("64x4x3hg-r128") == gathered and str(gathered) == "64x4x3hg-r128"
    assert Launch.parse("64x4x4g") == Launch(64, 4, 4, table=True)
    for bad in ("12x4", "128x4x2q", "", "64x4x3-rx", "64x4x3gh"):
        with pytest.raises(Fp8InputError, match="BLOCKxWARPSxSTAGES"):
            Launch.parse(bad)


def test_an_fp8_cache_takes_the_register_capped_launch_and_a_bf16_cache_does_not():
    assert LAUNCH[True] == Launch(64, 4, 3, f16=True, regs=128, table=True)
    assert not LAUNCH[False].regs and LAUNCH[False].table
