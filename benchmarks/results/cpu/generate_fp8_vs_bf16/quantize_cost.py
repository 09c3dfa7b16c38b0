"""What cpu_dequant's per-call activation quantization costs, at decode (M=1) and prefill (M=35)
sizes of SmolLM2-135M (K=576 and 1536): quantize to e4m3 then upcast to fp32, its parts, and two
other ways to upcast e4m3 (a 256-entry lookup table; an fp16 bit trick). Median of 200 calls, µs."""

import time

import torch

from fp8route.quant import quantize


def median_us(f, n=200):
    for _ in range(10):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e6


table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def fp16_trick(q):
    b = q.view(torch.uint8).to(torch.int16)
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16).float() * 256.0


def costs(x, scale):
    q = quantize(x, scale)
    assert torch.equal(table.take(q.view(torch.uint8).long()), q.float()) and torch.equal(fp16_trick(q), q.float())
    return {
        "quantize + upcast": median_us(lambda: quantize(x, scale).float()),
        "quantize": median_us(lambda: quantize(x, scale)),
        "upcast": median_us(lambda: q.float()),
        "upcast by table": median_us(lambda: table.take(q.view(torch.uint8).long())),
        "upcast by fp16 bits": median_us(lambda: fp16_trick(q)),
    }


for shape in [(1, 576), (1, 1536), (35, 576), (35, 1536)]:
    row = costs(torch.randn(*shape, dtype=torch.bfloat16) * 5, torch.tensor(0.02))
    print(shape, "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
