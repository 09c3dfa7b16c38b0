"""The silu_in_down kernel option's dispatch, on a CPU with a stand-in for a fusing backend: an MLP
hands its gate_up to the down projection only when the option is on and the backend the plan runs
at that M computes SiLU * up itself; otherwise it computes the product first, as before. Either way
the output is the same; a gate_up of the wrong width is one clear error. Under Triton's interpreter
(TRITON_INTERPRET=1) the real fusing backend, fp8_gemv, runs its kernel on CPU tensors too."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fp8route import Fp8InputError, Fp8Linear, set_kernel_options
from fp8route.backends import get_backend
from fp8route.kernels.fused import silu_mul
from fp8route.quant import quantize_per_tensor


class Fusing:
    """The reference backend, claiming to fuse: run_silu_mul computes the product, then the GEMM."""

    name, fuses_silu_mul = "stand-in", True

    def __init__(self) -> None:
        self.reference = get_backend("reference")
        self.calls: list[tuple[int, ...]] = []

    def run(self, x, operands):
        return self.reference.run(x, operands)

    def run_silu_mul(self, gate_up, operands):
        self.calls.append(tuple(gate_up.shape))
        return self.reference.run(silu_mul(gate_up, gate_up.shape[1] // 2), operands)


@pytest.fixture
def down(monkeypatch):
    weight, scale = quantize_per_tensor(torch.randn(24, 64))
    layer = Fp8Linear(weight, scale, torch.tensor(0.02), name="down_proj")
    fusing = Fusing()
    fused_routes = {d: tuple(fusing for _ in route) for d, route in layer.plan.routes.items()}
    monkeypatch.setattr(layer, "_plan", dataclasses.replace(layer.plan, routes=fused_routes))
    yield layer, fusing
    set_kernel_options(silu_in_down=False)


def test_off_by_default_the_caller_computes_the_product(down):
    layer, fusing = down
    gate_up = torch.randn(3, 128, dtype=torch.bfloat16)
    assert layer.forward_silu_mul(gate_up) is None and fusing.calls == []


def test_on_the_backend_takes_gate_up_and_gives_what_the_unfused_path_gives(down):
    layer, fusing = down
    set_kernel_options(silu_in_down=True)
    gate_up = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    fused = layer.forward_silu_mul(gate_up)
    assert fusing.calls == [(10, 128)] and fused.shape == (2, 5, 24)
    torch.testing.assert_close(fused, layer(silu_mul(gate_up, 64)), rtol=0, atol=0)
    assert layer.forward_silu_mul(gate_up.float()) is None  # fp32: not a fused kernel's input


def test_a_backend_that_does_not_fuse_leaves_the_product_to_the_caller():
    weight, scale = quantize_per_tensor(torch.randn(24, 64))
    layer = Fp8Linear(weight, scale, torch.tensor(0.02), name="down_proj")  # CPU: a non-fusing backend
    set_kernel_options(silu_in_down=True)
    try:
        assert layer.forward_silu_mul(torch.randn(3, 128, dtype=torch.bfloat16)) is None
    finally:
        set_kernel_options(silu_in_down=False)


def test_a_gate_up_of_the_wrong_width_is_one_clear_error(down):
    layer, _ = down
    set_kernel_options(silu_in_down=True)
    with pytest.raises(Fp8InputError, match=r"down_proj: gate_up's last dim must be 2K=128, got \(3, 64\)"):
        layer.forward_silu_mul(torch.randn(3, 64, dtype=torch.bfloat16))


@pytest.mark.interpreter
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="Triton's interpreter on a CPU (on a GPU, tests/kernels/test_decode_gemm_silu_in_down_gpu.py)",
)
def test_the_real_backend_fuses_through_its_kernel_bit_for_bit(monkeypatch):
    from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

    assert TRITON_IMPORT_ERROR is None, TRITON_IMPORT_ERROR
    weight, scale = quantize_per_tensor(torch.randn(48, 256))
    layer = Fp8Linear(weight, scale, torch.tensor(0.02), name="down_proj").to(torch.float16)
    gemv = get_backend("fp8_gemv")  # the plan a GPU makes at decode sizes, which a CPU cannot
    monkeypatch.setattr(layer, "_plan", dataclasses.replace(layer.plan, routes={
        dtype: tuple(gemv for _ in route) for dtype, route in layer.plan.routes.items()
    }))  # fmt: skip
    set_kernel_options(silu_in_down=True)
    try:
        for m in (1, 3, 8, 16):  # the CUDA-core kernel, then the wgmma one
            gate_up = (torch.randn(m, 512) * 2).to(torch.float16)
            fused = layer.forward_silu_mul(gate_up)
            assert fused is not None and torch.equal(fused, layer(silu_mul(gate_up, 256))), m
    finally:
        set_kernel_options(silu_in_down=False)
