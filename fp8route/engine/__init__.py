"""The runtime: a paged KV pool and its block manager (prefix caching), attention over it, the
model runner (packed prefill chunks, CUDA-graph decode), the static generate, load_model, and the
serving engine: scheduler (continuous batching, chunked prefill, preemption), LLMEngine and LLM."""

from fp8route.engine.causal_lm import CausalLM
from fp8route.engine.generate import Generation
from fp8route.engine.llm import LLM
from fp8route.engine.load import load_model
from fp8route.engine.request import CompletionOutput, RequestOutput
from fp8route.engine.sampling import SamplingParams

__all__ = ["LLM", "CausalLM", "CompletionOutput", "Generation", "RequestOutput", "SamplingParams", "load_model"]
