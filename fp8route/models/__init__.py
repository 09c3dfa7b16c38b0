"""The Llama-family model definition: config, layers, fused elementwise kernels, shapes, tensor-parallel
sharding. What runs it (KV pool, decode graphs, schedulers) is fp8route.engine."""

from fp8route.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
