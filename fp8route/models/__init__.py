"""The Llama-family model definition: config, layers, fused elementwise kernels, shapes, tensor-parallel
sharding. It imports nothing of fp8route.checkpoint: fp8route.loading builds a model from a folder,
and what runs it (KV pool, decode graphs, schedulers) is fp8route.engine."""

from fp8route.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
