"""Every Triton kernel of fp8route and the launch machinery they share, importable without the engine.

One module (or subpackage) per kernel family, each with its launch and, where the callers keep one,
its torch path:

- `quantize`: static per-tensor activation quantization to e4m3, and the device function every
  fused kernel quantizes with;
- `decode_gemm`: the decode-sized FP8 GEMM with the quantization (and optionally SiLU * up) fused
  in, behind the `fp8_gemv` backend;
- `fused`: the decoder's elementwise steps (RMSNorm, residual add + RMSNorm, RoPE, RoPE into the
  KV cache, SiLU * up);
- `peer_reduce`: tensor parallel's all-reduce fused with the residual add and RMSNorm after it;
- `paged_decode`: split-KV decode attention over the paged KV cache, the new token written inside;
- `paged_attention`: causal attention of a flat batch of decodes and prompt chunks over the cache;
- `argmax`: each row's greedy token.

Shared by them: `triton_support` (triton, or why it does not import), `launcher` (launching a
compiled kernel again without Triton's per-call binding), `options` (process-wide kernel options)
and `pdl` (programmatic dependent launch). `compile_check` compiles every kernel for sm_90 on a
machine without a GPU (`python -m fp8route.kernels.compile_check`).

These modules import torch, triton and fp8route's bottom modules (errors, quant, device) only; the
backends, models and engine import them, never the reverse. Nothing here imports triton at module
level except through `triton_support`, so a CPU-only install imports these modules and learns from
TRITON_IMPORT_ERROR why they cannot run.
"""
