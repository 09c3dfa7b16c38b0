"""LLM: the offline API, in the form vLLM and SGLang users know.

    llm = fp8route.LLM("path/to/Llama-3.1-8B-Instruct-FP8")
    outputs = llm.generate(["The capital of France is"], fp8route.SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)

Keyword arguments are EngineConfig's settings (fp8route.engine.config), checked once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

from fp8route.engine.config import EngineConfig
from fp8route.engine.llm_engine import LLMEngine
from fp8route.engine.load import load_model, resolve_model
from fp8route.engine.request import CompletionOutput, Request, RequestOutput
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.models.tokenizer import load_tokenizer
from fp8route.progress import TextProgress


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        config: EngineConfig | None = None,
        **settings: Any,
    ) -> None:
        config = (config or EngineConfig()).replace(model=str(model), **settings)
        folder = resolve_model(model)
        # skip_tokenizer_init (vLLM's name): token ids in and out, for a folder without tokenizer.json.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(folder)
        self.model = load_model(folder, policy=policy, config=config)
        self.config = config

    @property
    def engine(self) -> LLMEngine:
        return self.model.engine

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Fp8InputError("a text prompt needs the tokenizer: give token ids (skip_tokenizer_init=True)")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False).ids)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            return [int(t) for t in prompt]
        raise Fp8InputError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order: each a string or a list of token ids; one SamplingParams
        for all of them or one each. Every prompt is checked before any runs."""
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast("list[str | Sequence[int]]", [prompts] if one else list(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise Fp8InputError(f"{len(params)} SamplingParams for {len(batch)} prompts: give one, or one each")
        encoded = [self.encode(p) for p in batch]
        for i, (ids, p) in enumerate(zip(encoded, params, strict=True)):
            try:
                self.engine.check_prompt(ids, p)
            except Fp8InputError as e:
                raise Fp8InputError(f"prompt {i}: {e}") from None
        engine = self.engine
        requests = [
            engine.add_request(ids, p, prompt=prompt if isinstance(prompt, str) else None)
            for ids, p, prompt in zip(encoded, params, batch, strict=True)
        ]
        progress = TextProgress("generate") if use_tqdm and len(requests) > 1 else None
        done = 0
        try:
            while engine.has_unfinished:
                for update in engine.step():
                    done += update.finished
                if progress is not None:
                    progress(done, len(requests), f"{engine.num_running} running")
        except BaseException:
            for request in requests:
                engine.abort(request.request_id)
            engine.drain()
            raise
        return [self.output(r) for r in requests]

    def output(self, request: Request) -> RequestOutput:
        ids = request.output_token_ids
        text = "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
        completion = CompletionOutput(0, text, ids, request.finish_reason, request.stop_reason)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, [completion], request.finished,
            request.metrics, request.num_cached_tokens,
        )  # fmt: skip
