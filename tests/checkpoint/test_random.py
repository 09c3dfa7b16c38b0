"""Random checkpoints of each scheme, in the format `quantize --scheme` writes, load as any checkpoint does."""

import pytest
import torch
from checkpoint_helpers import BLOCKY

from fp8route import Fp8InputError, load_checkpoint
from fp8route.checkpoint.formats import DEFAULT_FORMAT
from fp8route.checkpoint.random import write_random


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_each_scheme_loads_in_its_default_format(tmp_path, scheme):
    folder = write_random(tmp_path / scheme, BLOCKY, fp8=True, device="cpu", scheme=scheme)
    ckpt = load_checkpoint(folder, device="cpu")
    assert (ckpt.fp8_scheme, ckpt.format) == (scheme, DEFAULT_FORMAT[scheme])
    assert len(ckpt.linears) == (10 if scheme == "block" else 8)  # block: gate/up (320 rows) stay apart
    assert all(layer.scheme == scheme for layer in ckpt.linears.values())
    assert all((layer.input_scale is not None) == (scheme == "tensor") for layer in ckpt.linears.values())
    assert ckpt.tensors["lm_head.weight"].dtype == torch.bfloat16


def test_the_default_is_per_tensor_and_bf16_has_no_scheme(tmp_path):
    assert load_checkpoint(write_random(tmp_path / "t", BLOCKY, fp8=True, device="cpu"), device="cpu").format == (
        "modelopt"
    )
    with pytest.raises(Fp8InputError, match="scheme='block' needs fp8=True"):
        write_random(tmp_path / "b", BLOCKY, fp8=False, device="cpu", scheme="block")
    with pytest.raises(Fp8InputError, match="unknown FP8 scheme 'rows'"):
        write_random(tmp_path / "r", BLOCKY, fp8=True, device="cpu", scheme="rows")  # type: ignore[arg-type]
