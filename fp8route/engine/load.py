"""load_model: a checkpoint folder -> a CausalLM ready to generate, FP8 or not."""

from __future__ import annotations

import os

import torch

from fp8route.engine.causal_lm import CausalLM
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_quant import check_kv_cache_dtype, kv_scales_for
from fp8route.linear.policy import Policy
from fp8route.models.load import load_parts
from fp8route.models.parallel import LmHead


def load_model(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_batch_size: int = 16,
    max_seq_len: int = 8192,
    policy: Policy | None = None,
    use_cuda_graphs: bool = True,
    all_reduce: str = "nccl",
    tp_lm_head: LmHead = "vocab",
    attention: str = "builtin",
    kv_cache_dtype: str = "auto",
) -> CausalLM:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) from a checkpoint folder, or a Hugging Face
    repository id ("org/name") in the local hub cache (fp8route.checkpoint.hub.resolve_model_path),
    with a KV pool for max_batch_size rows of max_seq_len positions (capped at the config's
    max_position_embeddings). config.json is checked against the tensors' header shapes (layers,
    sizes, heads, vocabulary, tied embeddings) before any weight is read.

    device defaults to CUDA when available. FP8 linears stay FP8 (planned by policy); every
    float tensor (embeddings, norms, unquantized linears, the KV cache) is kept in dtype.

    Under torch.distributed (more than one rank) each rank reads its slices of the checkpoint
    (fp8route.models.parallel); tp_lm_head="vocab" splits lm_head over the vocabulary and gathers
    the logits, "replicated" keeps a whole lm_head on every rank. Every rank returns full logits;
    all_reduce picks how row-parallel outputs are summed (fp8route.models.collectives.METHODS).
    attention="flashinfer" runs FlashInfer's prefill and decode attention over the same cache
    (the flashinfer extra, CUDA); "builtin" is SDPA for prefill and fp8route's decode kernel.
    kv_cache_dtype="fp8" keeps the KV cache in float8_e4m3fn with the checkpoint's per-layer K/V
    scales (1.0 and a warning when it has none; fp8route.engine.kv_quant); "auto" keeps it in dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    parts = load_parts(
        path, device, dtype=dtype, policy=policy, all_reduce=all_reduce, tp_lm_head=tp_lm_head,
        before_weights=lambda target: check_attention(attention, target),
    )  # fmt: skip
    scales = kv_scales_for(kv_cache_dtype, parts.kv_scales, parts.cfg.num_hidden_layers, str(path), parts.kv_scheme)
    if parts.max_positions is not None:
        max_seq_len = min(max_seq_len, parts.max_positions)
    model = CausalLM(
        parts.cfg,
        parts.linears,
        parts.tensors,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        dtype=dtype,
        device=parts.device,
        use_cuda_graphs=use_cuda_graphs,
        attention=attention,
        kv_scales=scales,
    )
    model.parallel = parts.parallel
    return model
