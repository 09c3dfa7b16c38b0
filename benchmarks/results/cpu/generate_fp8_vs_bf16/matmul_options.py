"""The matmuls a CPU could run cpu_dequant's GEMM with, on SmolLM2-135M's shapes at M=1 and 37:
median µs of fp32 (e4m3 values upcast), bf16 (e4m3 values are exact in bf16), and oneDNN's FP8
qlinear on the e4m3 tensors themselves; and each one's error against the exact product (fp64) on
random e4m3 operands: the median over output elements of |error| / |exact|, and the largest
|error| / sum_k |x_k w_k| (the scale any summation error is bounded by; elements near zero by
cancellation make the first measure's maximum meaningless)."""

import time

import torch


def median_us(f, n=30):
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e6


def errors(out, exact, magnitude):
    error = (out.double() - exact).abs()
    median = (error / exact.abs().clamp(min=1e-30)).median().item()
    return f"median {median:.1e}, max {(error / magnitude).max().item():.1e}"


torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
    w = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w32, wbf, packed = w.float(), w.to(torch.bfloat16), torch.ops.onednn.qlinear_prepack(w, None)
    for m in (1, 37):
        q = (torch.randn(m, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        exact = q.double() @ w.double().t()
        magnitude = q.double().abs() @ w.double().abs().t()

        def onednn(q=q, packed=packed):
            zero = torch.zeros(1, dtype=torch.int64)
            return torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, packed, torch.ones(1), zero, None, 1.0, 0, torch.float32, "none", [], ""
            )

        arms = {
            "fp32": lambda q=q, w32=w32: q.float() @ w32.t(),
            "bf16": lambda q=q, wbf=wbf: q.to(torch.bfloat16) @ wbf.t(),
            "onednn fp8": onednn,
        }
        cells = [f"{name} {median_us(f):.0f} us, {errors(f(), exact, magnitude)}" for name, f in arms.items()]
        print(f"N={n} K={k} M={m}: " + "; ".join(cells))
