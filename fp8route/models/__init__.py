"""Compact model runners: the Llama-family definition, and the engine that generates with it."""

from fp8route.models.causal_lm import CausalLM
from fp8route.models.generate import Generation
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
from fp8route.models.load import load_model

__all__ = ["CausalLM", "Generation", "LlamaConfig", "LlamaForCausalLM", "load_model"]
