"""LLM: the offline API, in the form vLLM and SGLang users know.

    llm = fp8route.LLM("path/to/Llama-3.1-8B-Instruct-FP8")
    outputs = llm.generate(["The capital of France is"], fp8route.SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)

Keyword arguments are EngineConfig's settings (fp8route.engine.config), checked once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8route.checkpoint.gguf_tokenizer import apply_chat_template
from fp8route.engine.config import EngineConfig
from fp8route.engine.detokenize import TextStream
from fp8route.engine.llm_engine import LLMEngine, Update
from fp8route.engine.load import resolve_model
from fp8route.engine.request import CompletionOutput, Request, RequestOutput, logprob_dict
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.structured import Grammars
from fp8route.errors import Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.models.tokenizer import load_tokenizer
from fp8route.progress import TextProgress

Prompt = (
    str | Sequence[int] | Mapping[str, Any]
)  # text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}
Message = Mapping[str, str]


def _grammar_source(engine: LLMEngine, tokenizer: Any, folder: Path) -> Callable[[], Grammars]:
    """Structured output compiles against the tokenizer, read when a request first asks for it. Made
    here, not in LLM.__init__: the first engine's load freezes the heap (llm_engine.freeze_startup_heap),
    and a closure's cells made there exist before that, so a cycle through them (engine, function,
    cell, engine) would never be collected, nor the engine's weights and KV pool."""
    vocab = engine.model.cfg.vocab_size
    return lambda: Grammars(tokenizer or load_tokenizer(folder), vocab, engine.eos_token_ids)


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
        self.folder = folder
        # skip_tokenizer_init (vLLM's name): token ids in and out, for a folder without tokenizer.json.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(folder)
        self.engine = engine = LLMEngine.from_config(config.replace(model=str(folder)), policy)
        self.config = config
        engine.grammar_source = _grammar_source(engine, self.tokenizer, folder)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text is tokenized without special tokens (a chat template adds its own)."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise Fp8InputError(f"a prompt dict holds 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Fp8InputError("a text prompt needs the tokenizer: give token ids (skip_tokenizer_init=True)")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False).ids)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise Fp8InputError("a list prompt holds token ids (integers); give a string for text")
            return [int(t) for t in prompt]
        raise Fp8InputError(f"a prompt is a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order (with n completions when its params ask for n): each prompt
        a string, a list of token ids or a vLLM prompt dict; one SamplingParams for all of them or one
        each. Every prompt is checked before any runs."""
        batch = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise Fp8InputError(f"{len(params)} SamplingParams for {len(batch)} prompts: give one, or one each")
        encoded = []
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            try:
                if p.stop and self.tokenizer is None:
                    raise Fp8InputError("stop strings are matched on the text, which needs the tokenizer (this LLM "
                                        "has skip_tokenizer_init=True): give stop_token_ids instead")  # fmt: skip
                ids = self.encode(prompt)
                self.engine.check_prompt(ids, p)
            except Fp8InputError as e:
                raise Fp8InputError(f"prompt {i}: {e}") from None
            encoded.append(ids)
        return self._run(encoded, params, [_text(p) for p in batch], use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """generate for one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered with the tokenizer's chat template and a generation prompt."""
        if not messages:
            raise Fp8InputError("chat: no messages; give a list of {'role': ..., 'content': ...} dicts")
        chats = [messages] if isinstance(messages[0], Mapping) else messages
        texts = [apply_chat_template(self.folder, list(chat)) for chat in chats]  # type: ignore[arg-type]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self, encoded: list[list[int]], params: list[SamplingParams], texts: list[str | None], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        requests = [
            engine.add_request(ids, p, prompt=text) for ids, p, text in zip(encoded, params, texts, strict=True)
        ]
        groups = [engine.samples(r) for r in requests]
        streams = {id(r): TextStream(self.tokenizer, r.prompt_token_ids, r.params.stop) for g in groups for r in g
                   if r.params.stop}  # fmt: skip
        total = sum(len(g) for g in groups)
        progress = TextProgress("generate") if use_tqdm and total > 1 else None
        done = 0
        try:
            while engine.has_unfinished:
                for update in engine.step():
                    stream = streams.get(id(update.request))
                    cut = stream is not None and self._cut_at_stop(stream, update)  # its last tokens too
                    done += update.finished or cut
                if progress is not None:
                    progress(done, total, f"{engine.num_running} running")
        except BaseException:
            for request in requests:
                engine.abort(request.group_id)
            engine.drain()
            raise
        return [self.output(group, streams) for group in groups]

    def _cut_at_stop(self, stream: TextStream, update: Update) -> bool:
        """Push the update's tokens into its sample's text; True when they complete a stop string of a
        sample still running, which is then aborted, freeing its blocks (as the server does)."""
        if stream.stop_reason is not None:
            return False
        stream.push(update.new_token_ids, final=update.finished)
        if stream.stop_reason is None or update.finished:
            return False
        return self.engine.abort(update.request.request_id)

    def output(
        self, samples: Request | Sequence[Request], streams: Mapping[int, TextStream] | None = None
    ) -> RequestOutput:
        """A request's result in vLLM's shape: one CompletionOutput per sample; a sample whose text
        (streams, by id of its Request) met a stop string ends before it, finish_reason "stop"."""
        samples = [samples] if isinstance(samples, Request) else list(samples)
        first = samples[0]
        decode = self._decode_one if self.tokenizer is not None else None
        completions = []
        for request in samples:
            ids = request.output_token_ids
            text = "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
            finish: str | None = request.finish_reason
            stop: int | str | None = request.stop_reason
            cut = (streams or {}).get(id(request))
            if cut is not None and cut.stop_reason is not None:
                text, finish, stop = cut.text, "stop", cut.stop_reason
            logprobs, cumulative = None, None
            if request.logprobs is not None:
                logprobs = [logprob_dict(e, decode) for e in request.logprobs]
                cumulative = sum(e.logprob for e in request.logprobs)
            completions.append(CompletionOutput(request.index, text, ids, finish, stop, logprobs, cumulative))
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None if e is None else logprob_dict(e, decode) for e in first.prompt_logprobs]
        return RequestOutput(
            first.group_id, first.prompt, first.prompt_token_ids, completions, all(r.finished for r in samples),
            first.metrics, first.num_cached_tokens, prompt_logprobs,
        )  # fmt: skip

    def _decode_one(self, token: int) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them, told apart as vLLM does (a list of ints is one prompt)."""
    if prompts is None:
        raise Fp8InputError("no prompts: give a string, a list of token ids, a prompt dict, or a list of those")
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise Fp8InputError(
            f"prompts must be a string, token ids, a prompt dict or a list, got {type(prompts).__name__}"
        )
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _text(prompt: Prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None
