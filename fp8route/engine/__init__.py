"""The runtime: EngineConfig (every setting once), the scheduler (requests, KV blocks, prefix cache)
and its SchedulerOutput (requests by id), the model runner (the KV pool it sizes, device tables,
graphs; one forward per step), the sampler, LLMEngine over a plain model, and the APIs over it: LLM,
load_model's CausalLM handle (generate, the full forward), AsyncLLM."""

from fp8route.engine.causal_lm import CausalLM, load_model
from fp8route.engine.config import EngineConfig
from fp8route.engine.llm import LLM
from fp8route.engine.request import CompletionOutput, RequestOutput
from fp8route.engine.sampling import SamplingParams

__all__ = ["LLM", "CausalLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "load_model"]
