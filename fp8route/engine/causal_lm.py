"""CausalLM: a Llama-family model with an engine to generate with.

`model(ids)` is the full forward (no cache, for evaluation); `model.generate(ids, n)` runs the
rows of a static batch as requests of the model's engine: the same scheduler, KV pool, steps and
sampler as `LLM.generate` and the server, so the same seed gives the same tokens either way, and a
batch larger than the engine's max_num_seqs, or than its pool holds at once, queues (or is preempted
and recomputed) instead of failing. The model definition
(fp8route.models.llama) holds no runtime state: the engine does.

The engine's KV pool takes what is left of gpu_memory_utilization x the GPU's memory once the
weights are loaded and a step of max_num_batched_tokens has been run to measure its activations
(num_kv_blocks sets it instead); on a CPU it holds CPU_KV_TOKENS tokens.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fp8route.engine.config import EngineConfig
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_pool import blocks_for
from fp8route.engine.kv_quant import KVScales
from fp8route.engine.llm_engine import LLMEngine
from fp8route.engine.request import Request
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
from fp8route.models.token_ids import check_token_ids

DEFAULT_CONTEXT = 8192  # for a config without max_position_embeddings
CPU_KV_TOKENS = 32768  # a CPU pool's size: no device memory to size it from
_GRAPH_RESERVE = 1 << 30  # decode graphs' own memory (logits and activations per bucket), kept free


def model_context(cfg: LlamaConfig) -> int:
    """The longest prompt plus output the model takes: its max_position_embeddings."""
    return cfg.max_position_embeddings or DEFAULT_CONTEXT


class CausalLM(LlamaForCausalLM):
    def __init__(
        self,
        cfg: LlamaConfig,
        linears: Mapping[str, nn.Module],
        tensors: Mapping[str, torch.Tensor],
        config: EngineConfig | None = None,
        *,
        device: torch.device | None = None,
        kv_scales: KVScales | None = None,
        eos_token_ids: Sequence[int] = (),
        quiet: bool = False,
    ) -> None:
        """The model over these parts, and its engine (config; device: the tensors' by default)."""
        super().__init__(cfg, linears, tensors)
        self.config = config = config or EngineConfig()
        self.device = device or next(iter(tensors.values())).device
        check_attention(config.attention, self.device)
        context = model_context(cfg)
        if config.max_model_len is not None and config.max_model_len > context:
            raise Fp8InputError(f"max_model_len={config.max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = config.max_model_len or context
        self.kv_scales = kv_scales
        self.parallel: str | None = None  # how this rank shares the model, when it is sharded
        self.engine = LLMEngine(
            self, config, device=self.device, max_model_len=self.max_model_len, num_blocks=2,
            kv_scales=kv_scales, eos_token_ids=eos_token_ids,
        )  # fmt: skip
        self._size_engine(quiet)

    def _size_engine(self, quiet: bool) -> None:
        """The pool's real size, then every graph and kernel variant a step can meet, captured and
        compiled before any request waits for them."""
        engine, runner, config = self.engine, self.engine.runner, self.config
        start = time.perf_counter()
        graphs = runner.prefill_graphs_for(1)
        if graphs is not None:  # before the pool is sized, which then counts their memory as taken
            graphs.capture_all()
        engine.resize_pool(config.num_kv_blocks or self._fit_blocks())
        if runner.use_cuda_graphs:
            runner.capture_decode_graphs(config.max_num_seqs)
            runner.warm_up()
            torch.cuda.synchronize(self.device)
        if quiet:
            return
        pool = runner.pool
        eager = runner.why_prefill_eager() if runner.use_cuda_graphs and graphs is None else None
        print(
            f"fp8route: KV cache {pool.capacity_tokens} tokens ({pool.num_blocks - 1} blocks of {pool.block_size}, "
            f"{pool.nbytes / 2**30:.2f} GiB {str(pool.dtype).removeprefix('torch.')}) on {pool.device}; context "
            f"{self.max_model_len} tokens"
            + (f"; graphs captured in {time.perf_counter() - start:.1f} s" if runner.use_cuda_graphs else "")
            + (f"; mixed steps run eagerly: {eager}" if eager else "")
            + (f"; {torch.get_num_threads()} CPU threads" if self.device.type == "cpu" else ""),
            file=sys.stderr,
        )

    def _fit_blocks(self) -> int:
        """Blocks that fit what is left after the weights and one largest step's activations; every
        rank of a tensor-parallel group takes the smallest count, so that all schedule alike."""
        runner, config = self.engine.runner, self.config
        per_block = runner.pool.bytes_per_token * config.block_size
        if self.device.type != "cuda":
            tokens = min(CPU_KV_TOKENS, config.max_num_seqs * self.max_model_len)
            return 1 + blocks_for(tokens, config.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = min(runner.max_tokens, self.max_model_len)
        runner.dummy_forward(tokens, min(config.max_num_seqs, tokens - 1))
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activations - _GRAPH_RESERVE
        blocks = torch.tensor(budget // per_block, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
        if int(blocks) < 2:
            raise Fp8InputError(
                f"no GPU memory left for the KV cache: {budget / 2**30:.2f} GiB after the weights and a "
                f"{tokens}-token step at gpu_memory_utilization={config.gpu_memory_utilization}; raise it, or "
                "lower max_num_batched_tokens"
            )
        return int(blocks) + 1

    @property
    def kv_cache_dtype(self) -> str:
        return "auto" if self.kv_scales is None else "fp8"

    @property
    def attention(self) -> str:
        return self.config.attention

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]: the full causal forward, no cache, over groups
        of rows of at most max_num_batched_tokens tokens (a larger batch is safe, not one launch)."""
        check_token_ids("model(input_ids)", input_ids, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        dtype = dtype or self.config.torch_dtype
        rows = max(1, self.engine.runner.max_tokens // input_ids.shape[-1])
        parts = [self.logits(ids, dtype) for ids in input_ids.split(rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CausalLM:
        super()._apply(fn, recurse)
        if hasattr(self, "engine"):  # graphs replay the tensors they captured, not the moved ones
            self.engine.runner.drop_graphs()
        return self

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        on_token: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Continue each row of input_ids [B, T] by up to max_new_tokens tokens -> [B, T + max_new_tokens].

        Rows of different lengths: right-pad them to T and pass prompt_lengths (row b's prompt is
        input_ids[b, :prompt_lengths[b]]); its new tokens start at prompt_lengths[b]. temperature 0
        is greedy; otherwise tokens are sampled from the top_p nucleus, each row from the stream of
        `seed` (as SamplingParams(seed=seed) samples). A row stops after emitting an id in eos_token_id
        (the model's own EOS does not stop it). on_token(step, tokens [B]) sees each engine step's new
        tokens on the host (pad for rows that got none)."""
        batch, width = check_token_ids("generate", input_ids, self.cfg.vocab_size)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise Fp8InputError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        eos = _eos_ids(eos_token_id)
        params = SamplingParams(
            max_tokens=max(max_new_tokens, 1), temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=eos,
            ignore_eos=True,
        )  # fmt: skip
        lengths = _prompt_lengths(prompt_lengths, batch, width)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        rows = input_ids.tolist()
        prompts = [rows[b][:n] for b, n in enumerate(lengths)]
        out = torch.full((batch, width + max_new_tokens), pad, dtype=torch.int64)
        for b, ids in enumerate(prompts):
            out[b, : len(ids)] = torch.tensor(ids)
        if max_new_tokens > 0:
            engine = self.engine
            _run_rows(engine, _submit_rows(engine, prompts, params), out, lengths, pad, on_token)
        return out.to(input_ids.device)


def _submit_rows(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """generate's rows as requests of an idle engine, every row checked before any is queued."""
    if engine.has_unfinished:
        raise Fp8InputError("generate: the model's engine is serving other requests; wait for them to finish")
    for i, ids in enumerate(prompts):
        try:
            engine.check_prompt(ids, params)
        except Fp8InputError as e:
            raise Fp8InputError(f"generate: row {i}: {e}") from None
    return [engine.add_request(ids, params, request_id=f"generate-{i}") for i, ids in enumerate(prompts)]


def _run_rows(
    engine: LLMEngine,
    requests: list[Request],
    out: torch.Tensor,
    lengths: list[int],
    pad: int,
    on_token: Callable[[int, torch.Tensor], None] | None,
) -> None:
    """Step the engine until every request is done, writing row b's new tokens into out after its
    prompt (lengths[b]); anything raised, an interrupt included, aborts the rows and drains the engine."""
    batch = len(requests)
    row_of = {id(r): b for b, r in enumerate(requests)}
    written = [0] * batch
    step = 0
    try:
        while engine.has_unfinished:
            updates = engine.step()
            news = torch.full((batch,), pad, dtype=torch.int64)
            got = False
            for update in updates:
                b = row_of[id(update.request)]
                for token in update.new_token_ids:
                    out[b, lengths[b] + written[b]] = token
                    news[b] = token
                    written[b] += 1
                    got = True
            if on_token is not None and got:
                on_token(step, news)
                step += 1
    except BaseException:
        for request in requests:
            engine.abort(request.request_id)
        engine.drain()
        raise


def _prompt_lengths(lengths: Sequence[int] | torch.Tensor | None, batch: int, width: int) -> list[int]:
    if lengths is None:
        return [width] * batch
    values = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(values) != batch or any(not 1 <= n <= width for n in values):
        raise Fp8InputError(
            f"generate: prompt_lengths must give each of the {batch} rows a length in 1..{width} "
            f"(the width of input_ids), got {values}"
        )
    return values


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
