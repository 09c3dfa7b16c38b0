"""How far each block backend's output lies from the exact product (bf16 x times the dequantized weight) and
from the reference of quantize_activation's x codes, on the 8B shapes: flashinfer_block quantizes bf16 x with
its own group scales, so only the first is a fair bound for it (tests/gpu/test_schemes_gpu.py).

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/scripts/flashinfer_block_error.py   # FlashInfer in /tmp/site
"""

from __future__ import annotations

import sys

import torch

sys.path[:0] = ["tests", "tests/gpu"]
from helpers import rel_error  # noqa: E402
from test_schemes_gpu import layer_of  # noqa: E402

from fp8route import Policy  # noqa: E402
from fp8route.schemes import dequantize_weight, quantize_activation, scaled_matmul  # noqa: E402

for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    for m in (1, 16, 512):
        for name in ("flashinfer_block", "triton_block", "cublas_block"):
            layer = layer_of("block", n, k, seed=m + n)
            layer.replan(policy=Policy(force=name))
            g = torch.Generator(device="cuda").manual_seed(m)
            x = (torch.randn(m, k, generator=g, device="cuda") * 2).to(torch.bfloat16)
            xq, xs = quantize_activation(x, "block")
            quantized = scaled_matmul(xq, xs, layer.weight, layer.weight_scale, "block") + layer.bias.float()
            exact = x.float() @ dequantize_weight(layer.weight, layer.weight_scale, "block").t() + layer.bias.float()
            out = layer(x)
            print(
                f"{n}x{k} M={m} {name}: from the quantized-x reference {rel_error(out, quantized):.5f}, from the "
                f"exact product {rel_error(out, exact):.5f} (the scheme's own: {rel_error(quantized, exact):.5f})"
            )
