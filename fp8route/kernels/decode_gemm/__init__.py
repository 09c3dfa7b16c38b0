"""The decode GEMM: static per-tensor FP8 linear for small M, activation quantization fused in.

    out = (q(x) @ w.T) * input_scale * weight_scale + bias,   q(x) = e4m3(clamp(x / input_scale, +-448))

A library FP8 GEMM pays one more launch for the separate quantization kernel and, at decode sizes,
sits well above the memory floor; this kernel fuses the quantization and splits K to put enough
loads in flight. How it measures against cuBLASLt and CUTLASS is in benchmarks/DECODE.md; the router
decides per layer and M bucket by measurement.

Two kernels behind one launch, picked per (N, K, M bucket) by `configs.choose_config`:
- CUDA-core (M <= 8): 16-32-row blocks, each lane streams 16 contiguous weight bytes per row and
  K-step with one 128-bit load, converts them to fp32 (exact) and multiplies by its quantized x;
  rows are reduced across the warp. No token padding, no shared-memory staging.
- wgmma (M 2..128): swap AB, the weight rows on the MMA's M side (64 to 256 per tile) and the tokens
  on its N side (16..64), so the weight goes straight from shared memory into the tensor cores.
Both split K; each split writes its fp32 partial to a workspace and the last CTA of a tile (an
integer counter tells which) sums the partials in split order. The counter is reset by that CTA, so
the kernel is graph-safe, and the sum order never depends on timing, so the bits repeat run to run.

Modules: `configs` (launch configurations, pure Python), `kernels` (the Triton code), `launch`.
"""
