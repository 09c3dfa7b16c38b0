"""Compact model runners for end-to-end checks and figures."""

from fp8route.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
