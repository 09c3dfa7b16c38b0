"""Programmatic dependent launch: a decode GEMM launched inside pdl_scope starts while the kernel
before it runs, and must still read the x that kernel writes (its wait), eager and in a CUDA graph."""

import pytest
import torch

from fp8route.backends.kernels.decode.configs import DecodeConfig
from fp8route.backends.kernels.decode.launch import decode_gemm
from fp8route.backends.kernels.triton_support import pdl_scope, use_pdl
from fp8route.models.fused import silu_mul

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
CONFIGS = [
    DecodeConfig(16, 2048, 1, 1, 8, 1, cuda_core=True),  # two K steps, each loaded before the wait
    DecodeConfig(32, 512, 1, 4, 8, 1, cuda_core=True),  # split K: workspace and counters after the wait
    DecodeConfig(16, 512, 1, 1, 4, 3, cuda_core=True),  # pipelined: one wait before the loop
]


def _operands(n: int = 4096, k: int = 4096) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(FP8)
    # x is row 0 of silu(gate) * up over many rows: a kernel long enough for an early start to show.
    gate_up = torch.randn(2048, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)
    scales = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")
    return weight, gate_up, *scales


@pytest.mark.skipif(not torch.cuda.is_available() or not use_pdl(torch.device("cuda")), reason="needs SM90+")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gemm_reads_the_x_the_kernel_before_writes(config):
    weight, gate_up, w_scale, x_scale = _operands()
    k = weight.shape[1]

    def step() -> torch.Tensor:
        x = silu_mul(gate_up, k)[:1]
        return decode_gemm(x, weight, w_scale, x_scale, None, torch.bfloat16, config=config)

    expected = step()  # outside the scope: no PDL
    torch.cuda.synchronize()
    for _ in range(20):
        with pdl_scope():
            got = step()
        assert torch.equal(got, expected)
    step_in_scope = pdl_scope()(step)
    step_in_scope()  # compiles, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step_in_scope()
    for _ in range(20):
        gate_up.mul_(-1)  # new x every replay
        graph.replay()
        assert torch.equal(captured, step())
