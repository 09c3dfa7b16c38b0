"""LLM: the offline API, in the form vLLM and SGLang users know.

    llm = fp8route.LLM("path/to/Llama-3.1-8B-Instruct-FP8")
    outputs = llm.generate(["The capital of France is"], fp8route.SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)

The KV pool takes what is left of gpu_memory_utilization x the GPU's memory once the weights are
loaded and a prefill of max_num_batched_tokens has been run to measure its activations.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from fp8route.checkpoint.hub import resolve_model_path
from fp8route.engine.causal_lm import BLOCK_SIZE, CausalLM
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_pool import blocks_for
from fp8route.engine.kv_quant import check_kv_cache_dtype, kv_scales_for
from fp8route.engine.llm_engine import ASYNC_WITH_FLASHINFER, LLMEngine
from fp8route.engine.request import CompletionOutput, Request, RequestOutput
from fp8route.engine.runner import DecodeRows
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.models.load import load_parts
from fp8route.models.tokenizer import load_tokenizer
from fp8route.progress import TextProgress

DEFAULT_CONTEXT = 8192  # for a config.json without max_position_embeddings (load_model's default too)
CPU_KV_TOKENS = 32768  # a CPU pool's default size: no device memory to size it from
_GRAPH_RESERVE = 1 << 30  # decode graphs' own memory (logits and activations per bucket), kept free


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A checkpoint folder, a repository id in the local Hugging Face hub cache, or `smollm2` for
    the packaged SmolLM2-135M-Instruct in FP8."""
    if str(model) == "smollm2":
        from fp8route.checkpoint.smollm2 import smollm2_folder

        return smollm2_folder(progress=TextProgress("preparing smollm2"))
    return resolve_model_path(model)


def eos_token_ids(config: dict[str, Any]) -> list[int]:
    value = config.get("eos_token_id")
    return [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        policy: Policy | None = None,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
        block_size: int = BLOCK_SIZE,
        num_kv_blocks: int | None = None,
        attention: str = "builtin",
        kv_cache_dtype: str = "auto",
        use_cuda_graphs: bool = True,
        skip_tokenizer_init: bool = False,
        record_stats: bool = False,
        mixed_steps: bool = False,
        async_scheduling: bool | None = None,
        prefill_graphs: bool = True,
    ) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise Fp8InputError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise Fp8InputError(
                f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs, got {max_num_seqs} and "
                f"{max_num_batched_tokens}"
            )
        check_kv_cache_dtype(kv_cache_dtype)
        if async_scheduling and attention == "flashinfer":
            raise Fp8InputError(ASYNC_WITH_FLASHINFER)
        folder = resolve_model(model)
        from fp8route.checkpoint.formats import CONFIG, read_json

        config = read_json(folder / CONFIG)
        # skip_tokenizer_init (vLLM's name): token ids in and out, for a folder without tokenizer.json.
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(folder)
        parts = load_parts(
            folder, device, dtype=dtype, policy=policy,
            before_weights=lambda target: check_attention(attention, target),
        )  # fmt: skip
        scales = kv_scales_for(
            kv_cache_dtype, parts.kv_scales, parts.cfg.num_hidden_layers, str(folder), parts.kv_scheme
        )
        context = parts.max_positions or DEFAULT_CONTEXT
        if max_model_len is not None and max_model_len > context:
            raise Fp8InputError(f"max_model_len={max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = max_model_len or context
        self.model = CausalLM(
            parts.cfg, parts.linears, parts.tensors, max_batch_size=max_num_seqs, max_seq_len=self.max_model_len,
            dtype=dtype, device=parts.device, use_cuda_graphs=use_cuda_graphs, attention=attention,
            num_blocks=2, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            max_prefill_tokens=max_num_batched_tokens, kv_scales=scales,
        )  # fmt: skip
        self.model.runner.use_prefill_graphs = prefill_graphs
        cuda_graphs = use_cuda_graphs and self.model.device.type == "cuda"
        if cuda_graphs:  # before the pool is sized, which then counts their memory as taken
            self._capture_prefill_graphs()
        if num_kv_blocks is None:
            num_kv_blocks = self._fit_pool(gpu_memory_utilization, max_num_batched_tokens, mixed_steps)
        self.model.resize_pool(num_kv_blocks)
        pool = self.model.pool
        print(
            f"fp8route: KV cache {pool.capacity_tokens} tokens ({pool.num_blocks - 1} blocks of {pool.block_size}, "
            f"{pool.nbytes / 2**30:.2f} GiB {str(pool.dtype).removeprefix('torch.')}) on {pool.device}; context "
            f"{self.max_model_len} tokens"
            + ("" if parts.max_positions else " (config.json has no max_position_embeddings: assumed)"),
            file=sys.stderr,
        )
        self.engine = LLMEngine(
            self.model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=eos_token_ids(config), record_stats=record_stats, mixed_steps=mixed_steps,
            async_scheduling=async_scheduling,
        )  # fmt: skip
        if cuda_graphs:
            self._capture_graphs(max_num_seqs)

    def _fit_pool(self, utilization: float, prefill_tokens: int, mixed_steps: bool) -> int:
        """Blocks that fit what is left after the weights and one largest prefill's activations."""
        model = self.model
        per_block = model.pool.bytes_per_token * model.pool.block_size
        if model.device.type != "cuda":
            tokens = min(CPU_KV_TOKENS, model.max_batch_size * self.max_model_len)
            return 1 + blocks_for(tokens, model.pool.block_size)
        device = model.device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        # A profile forward of the largest step: a chunk, with mixed steps every row decoding at its
        # end (their decode attention and lm_head rows); every token's K/V goes to the scratch block.
        tokens = min(prefill_tokens, self.max_model_len)
        rows = min(model.max_batch_size, tokens - 1) if mixed_steps else 0
        pad, scratch = model.pool.pad_row, [0] * model.pool.max_blocks_per_seq
        tail = DecodeRows([0] * rows, [0] * rows, [pad] * rows, [scratch] * rows) if rows else None
        model.runner.prefill([[0] * (tokens - rows)], [0], [pad], [scratch], [0], tail)
        torch.cuda.synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - before
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * utilization) - (total - free) - activations - _GRAPH_RESERVE
        blocks = budget // per_block
        if blocks < 2:
            raise Fp8InputError(
                f"no GPU memory left for the KV cache: {budget / 2**30:.2f} GiB after the weights and a "
                f"{tokens}-token prefill at gpu_memory_utilization={utilization}; raise it, or lower "
                "max_num_batched_tokens"
            )
        return int(blocks) + 1

    def _capture_graphs(self, max_num_seqs: int) -> None:
        """Every decode bucket's graph now, so the first requests do not wait for captures (and with
        mixed steps the decode kernel's variants their tails take)."""
        runner = self.model.runner
        device = self.model.device
        start = time.perf_counter()
        from fp8route.engine.decode_graphs import buckets

        sizes = buckets(max_num_seqs)
        for size in sizes:
            pad = torch.full((size,), self.model.pool.pad_row, dtype=torch.int64, device=device)
            zeros = torch.zeros(size, dtype=torch.int64, device=device)
            runner.decode(zeros, zeros, pad, host_lengths=[1] * size, host_blocks=[[0]] * size)
        torch.cuda.synchronize(device)
        print(f"fp8route: captured {len(sizes)} decode graphs in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if self.engine.mixed_steps:  # the tails' decode kernels, which no graph captured
            runner.warm_decode_tail()

    def _capture_prefill_graphs(self) -> None:
        """Every prefill bucket's pieces (fp8route.engine.prefill_graphs), when they apply."""
        runner = self.model.runner
        prefill = runner.prefill_graphs_for(1)
        if prefill is None:
            if runner.use_prefill_graphs:
                print(
                    f"fp8route: prefills run eagerly, not from CUDA graphs: {runner.why_prefill_eager()}",
                    file=sys.stderr,
                )
            return
        start = time.perf_counter()
        prefill.capture_all()
        torch.cuda.synchronize(self.model.device)
        print(
            f"fp8route: captured prefill graphs for {len(prefill.sizes)} sizes up to {prefill.max_tokens} tokens "
            f"in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )

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
