"""CausalLM and load_model: a checkpoint as one object to score and generate with.

`model(ids)` is the full forward (no cache, for evaluation); `model.generate(ids, n)` continues a
static batch through the engine (fp8route.engine.generate). The handle holds the engine, which
holds the plain model (fp8route.models.llama: weights and the forward, no runtime state): the
engine's KV pool takes what is left of gpu_memory_utilization x the GPU's memory once the weights
are loaded and a step of max_num_batched_tokens has been run to measure its activations
(num_kv_blocks sets it instead); on a CPU it holds CPU_KV_TOKENS tokens.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from fp8route.engine import generate as static
from fp8route.engine.config import EngineConfig
from fp8route.engine.llm_engine import LLMEngine
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.policy import Policy
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
from fp8route.models.token_ids import check_token_ids


class CausalLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        """What the handle does not have: said so, pointing at the module where it has it."""
        if name != "engine" and hasattr(nn.Module, name):
            raise AttributeError(
                f"load_model's CausalLM is a handle over its engine, not an nn.Module: {name!r} is the plain "
                f"model's, model.module.{name}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def module(self) -> LlamaForCausalLM:
        """The plain model: its weights and forward (its Fp8Linears are among its modules())."""
        return self.engine.model

    @property
    def linears(self) -> dict[str, Fp8Linear]:
        """The model's FP8 linears by module name: what fp8route.explain lists."""
        return {name: m for name, m in self.module.named_modules() if isinstance(m, Fp8Linear)}

    @property
    def cfg(self) -> LlamaConfig:
        return self.engine.model.cfg

    @property
    def config(self) -> EngineConfig:
        """The engine's settings, as it resolved them for this model and device."""
        return self.engine.config

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def parallel(self) -> str | None:
        """How this rank shares the model, when it is sharded."""
        return self.engine.parallel

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]: the full causal forward, no cache, over groups
        of rows of at most max_num_batched_tokens tokens (a larger batch is safe, not one launch)."""
        check_token_ids("model(input_ids)", input_ids, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        config = self.config
        assert config.max_num_batched_tokens is not None
        rows = max(1, config.max_num_batched_tokens // input_ids.shape[-1])
        parts = [self.module.logits(ids, dtype or config.torch_dtype) for ids in input_ids.split(rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options: Any) -> torch.Tensor:
        """Continue each row of input_ids [B, T] by up to max_new_tokens tokens -> [B, T + max_new_tokens];
        options and how: fp8route.engine.generate.generate (prompt_lengths, temperature, top_p, seed,
        eos_token_id, pad_token_id, on_token)."""
        return static.generate(self.engine, input_ids, max_new_tokens, **options)


def load_model(
    path: str | os.PathLike[str],
    *,
    policy: Policy | None = None,
    config: EngineConfig | None = None,
    quiet: bool = False,
    **settings: Any,
) -> CausalLM:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) and its engine from a checkpoint folder, a
    Hugging Face repository id ("org/name") in the local hub cache, or `smollm2`. Settings are
    EngineConfig's fields (config, then keyword arguments over it): device defaults to CUDA when
    available, dtype to bfloat16 for every float tensor (FP8 linears stay FP8, planned by policy).
    config.json is checked against the tensors' header shapes before any weight is read.

    Under torch.distributed (more than one rank) each rank reads its slices of the checkpoint
    (fp8route.models.parallel); tp_lm_head="vocab" splits lm_head over the vocabulary and gathers
    the logits, "replicated" keeps a whole lm_head on every rank; all_reduce picks how row-parallel
    outputs are summed (fp8route.models.collectives.METHODS). Every rank returns full logits.
    kv_cache_dtype="fp8" keeps the KV cache in float8_e4m3fn with the checkpoint's per-layer K/V
    scales (1.0 and a warning when it has none; fp8route.engine.kv_quant). pdl and quantize_upstream set the
    process's kernel options (fp8route.set_kernel_options) when given."""
    config = (config or EngineConfig()).replace(model=str(path), **settings)
    return CausalLM(LLMEngine.from_config(config, policy, quiet))
