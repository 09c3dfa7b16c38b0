"""End-to-end timing of a model as a user runs it: TTFT (prefill to the first token) and decode step
time per policy arm, in one process, with the memory ceiling measured in the same run.

An arm is `routed` (the routing table), `deterministic` (routed, the engine in its deterministic mode),
a backend forced for every layer through FP8ROUTE_FORCE (the mechanism a user has), or `bf16` (the same
weights unquantized). TTFT is the median of repeats after a warm-up of WARMUP_S; the decode step is
every row's once all are prefilled (step_split.measure), from the CUDA graphs generate uses.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fp8route.bench import step_split
from fp8route.engine.causal_lm import CausalLM, load_model
from fp8route.engine.config import EngineConfig
from fp8route.kernels.options import KernelOptions, kernel_options, set_kernel_options
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.policy import Policy
from fp8route.models.parallel import init_from_env
from fp8route.tuning.cupti import cupti_available

FORCE_ENV = "FP8ROUTE_FORCE"
START = KernelOptions()  # the kernel options a process starts with
WARMUP_S = 0.5


@dataclass(frozen=True)
class ArmOptions:
    """An arm's kernel options (fp8route.kernels.options). pdl None: the engine's own choice, each
    decode graph captured with PDL and without and the faster kept; True / False: every launch."""

    pdl: bool | None = None
    quantize_upstream: bool = START.quantize_upstream


@dataclass(frozen=True)
class E2ERow:
    arm: str
    batch: int
    input_tokens: int
    ttft_ms: float  # the batch's prompts through the engine to every row's first token
    prefill_tok_s: float
    decode_step_ms: float  # one new token for every row, every prompt prefilled (step_split.measure)
    decode_tok_s: float  # batch / step time
    weight_gb: float  # bytes read per decode step: the linears, lm_head and the embedding rows
    achieved_gbs: float  # (weight + KV bytes) / step time
    floor_fraction: float  # ((weight + KV bytes) / copy bandwidth) / step time
    tp: int = 1  # ranks the model is sharded over; times and bytes are rank 0's
    model_gb: float = 0.0  # GPU memory allocated once loaded: weights, KV cache, RoPE tables
    peak_gb: float = 0.0  # the most allocated at any point of the arm
    tokens_digest: str = ""  # of the greedy tokens generated: equal digests, equal tokens
    ranks_agree: bool | None = None  # every rank generated the same tokens (None: one rank)
    all_reduce: str = ""  # how row-parallel outputs were summed (tp > 1)
    ttft_min_ms: float = 0.0  # the spread of the repeats ttft_ms is the median of
    ttft_max_ms: float = 0.0
    attention: str = "builtin"  # fp8route.engine.config.ATTENTION
    kv_gb: float = 0.0  # KV bytes a decode step reads, mean over the timed steps
    pdl: bool | None = None  # ArmOptions.pdl: fp8route's kernels launched with PDL (None: measured per graph)
    quantize_upstream: bool = False  # and x quantized by the norm or SiLU-up kernel before a layer
    scheme: str = "tensor"  # the FP8 scheme of the checkpoint's linears (fp8route.schemes); bf16: none
    # One decode step's kernels by kind (fp8route.bench.step_split), device ms; zeros where not profiled.
    gemm_ms: float = 0.0
    attention_ms: float = 0.0
    rest_ms: float = 0.0
    kernels_per_step: float = 0.0
    top_kernels: tuple[tuple[str, float], ...] = ()  # the largest, (name, ms a step)
    bubble_ms: float = 0.0  # the GPU idle between a step's kernels at their boundaries (step_split.BUBBLE_US)
    stall_ms: float = 0.0  # and in longer stretches
    # Where pdl is None: each decode graph's (batch bucket, PDL kept, replay ms without, with).
    pdl_choices: tuple[tuple[int, bool, float, float], ...] = ()
    round: int = 0  # of bench e2e --rounds (from 0); every summary compares rows of one round
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype
    step_spread: float = 0.0  # (max - min) / median of the timed decode steps

    @property
    def label(self) -> str:
        label = self.arm if self.scheme in ("tensor", "bf16") else f"{self.arm} {self.scheme}"
        label += "" if self.attention == "builtin" else f" {self.attention}"
        label += "" if self.kv_cache_dtype == "auto" else f" kv-{self.kv_cache_dtype}"
        label += {None: "", True: " pdl", False: " pdl-off"}[self.pdl]
        label += " quantize-upstream" if self.quantize_upstream else ""
        label += f" round {self.round + 1}" if self.round else ""
        return label if self.tp == 1 else f"{label} tp{self.tp} {self.all_reduce}"


def weight_bytes(model: torch.nn.Module) -> int:
    """What a decode step must read at least: every linear's weight (FP8 or float), norms and lm_head."""
    total = 0
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            total += module.weight.numel() * module.weight.element_size()
    for name, p in model.named_parameters():
        if "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total


def timed_calls(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    """(seconds of each of repeats calls, the last call's result), after calling fn for WARMUP_S: a
    first call at a new size pays set-up, and a GPU idle while a model loaded starts at a low clock
    (the first arm's short prefills measured up to 1.7x slower with a one-call warm-up)."""
    start = time.perf_counter()
    while True:
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() - start >= WARMUP_S:
            break
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, result


def bench_arm(
    arm: str,
    folder: Path,
    batches: Sequence[int],
    inputs: Sequence[int],
    output: int,
    copy_gbs: float,
    *,
    repeats: int = 5,
    tp: int = 1,
    all_reduce: str = "nccl",
    attention: str = "builtin",
    kv_cache_dtype: str = "auto",
    options: ArmOptions = ArmOptions(),
) -> list[E2ERow]:
    """One arm's rows; the FP8ROUTE_FORCE it needs is set for its load only, and the kernel options
    for the arm. With tp > 1 this runs in every rank (fp8route.models.spawn.run_ranks), load_model
    joining the group."""
    before = kernel_options()
    set_kernel_options(pdl=bool(options.pdl), quantize_upstream=options.quantize_upstream)
    try:
        return _bench_arm(
            arm, folder, batches, inputs, output, copy_gbs, repeats, tp, all_reduce, attention, kv_cache_dtype, options
        )
    finally:
        set_kernel_options(pdl=before.pdl, quantize_upstream=before.quantize_upstream)


def _bench_arm(
    arm: str, folder: Path, batches: Sequence[int], inputs: Sequence[int], output: int, copy_gbs: float,
    repeats: int, tp: int, all_reduce: str, attention: str, kv_cache_dtype: str, options: ArmOptions,
) -> list[E2ERow]:  # fmt: skip
    device = init_from_env("cuda") or torch.device("cuda")  # under run_ranks: this rank's GPU, set current
    torch.cuda.reset_peak_memory_stats(device)
    config = _engine_config(device, batches, inputs, output, tp, all_reduce, attention, arm == "deterministic")
    config = config.replace(pdl=options.pdl, kv_cache_dtype=kv_cache_dtype)
    with _forced(arm):
        model = load_model(folder, policy=Policy.from_env(), config=config, quiet=True)
    run = _ArmRun(arm, tp, all_reduce, attention, kv_cache_dtype, options, copy_gbs, output, repeats,
                  model_gb=torch.cuda.memory_allocated() / 1e9, weight_bytes=weight_bytes(model.module),
                  scheme=model_scheme(model.module))  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.cfg.vocab_size
    rows = []
    for batch in batches:
        # Warm-up: the kernels' first calls.
        warm = torch.randint(0, vocab, (batch, 16), device="cuda", generator=gen)
        model.generate(warm, 4)
        for tokens in inputs:
            ids = torch.randint(0, vocab, (batch, tokens), device="cuda", generator=gen)
            rows.append(_measure(model, ids, run))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


@dataclass(frozen=True)
class _ArmRun:
    """What every row of one arm's run shares."""

    arm: str
    tp: int
    all_reduce: str
    attention: str
    kv_cache_dtype: str
    options: ArmOptions
    copy_gbs: float
    output: int
    repeats: int
    model_gb: float
    weight_bytes: int
    scheme: str


def model_scheme(model: torch.nn.Module) -> str:
    """The FP8 scheme of a model's linears ("bf16" when it has none)."""
    return next((m.scheme for m in model.modules() if isinstance(m, Fp8Linear)), "bf16")


@contextlib.contextmanager
def _forced(arm: str) -> Iterator[None]:
    """FP8ROUTE_FORCE set to the arm's backend (unset for routed, deterministic and bf16) within, as it
    was after."""
    saved = os.environ.get(FORCE_ENV)
    if arm not in ("routed", "deterministic", "bf16"):
        os.environ[FORCE_ENV] = arm
    else:
        os.environ.pop(FORCE_ENV, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = saved


def _engine_config(
    device: torch.device, batches: Sequence[int], inputs: Sequence[int], output: int, tp: int, all_reduce: str,
    attention: str, deterministic: bool = False,
) -> EngineConfig:  # fmt: skip
    # Each timed call brings prompts no earlier call did, but the repeats of one call share theirs: the
    # prefix cache would answer them, so it is off.
    budget = max(8192, max(inputs))
    # step_split.measure's first rows decode while the last prefill, then through its steps: room for both.
    # (Twice the prefill's steps: its decoding rows take some of each step's budget.)
    measured = 2 * -(-max(batches) * max(inputs) // budget) + step_split.TIMED + step_split.STEPS + 2
    return EngineConfig(
        device=str(device), max_num_seqs=max(batches), max_model_len=max(inputs) + max(output, measured),
        max_num_batched_tokens=budget, enable_prefix_caching=False, all_reduce=all_reduce, attention=attention,
        tp=tp, deterministic=deterministic,
    )  # fmt: skip


def _measure(model: CausalLM, ids: torch.Tensor, run: _ArmRun) -> E2ERow:
    """One (batch, prompt length) of the arm: TTFT, the decode step of every row once all are prefilled
    (step_split.measure), and the tokens of a full generate."""
    batch, tokens = ids.shape
    # TTFT: the batch's prompts through the engine to each row's first token.
    ttfts, _ = timed_calls(functools.partial(model.generate, ids, 1), run.repeats)
    generated = model.generate(ids, run.output)
    ttft = statistics.median(ttfts)
    steps = step_split.measure(model.engine, ids.tolist())
    if steps is None:  # _engine_config leaves the context room for the measured steps
        raise RuntimeError(f"bench e2e: {batch}x{tokens}: the engine's context ended before the decode steps timed")
    step = steps.wall_ms / 1e3
    kv = steps.positions * model.engine.kv_cache.bytes_per_token
    nbytes = run.weight_bytes
    floor = (nbytes + kv) / (run.copy_gbs * 1e9)
    return E2ERow(
        run.arm,
        batch,
        tokens,
        ttft * 1e3,
        batch * tokens / ttft,
        step * 1e3,
        batch / step,
        nbytes / 1e9,
        (nbytes + kv) / step / 1e9,
        floor / step,
        run.tp,
        run.model_gb,
        torch.cuda.max_memory_allocated() / 1e9,
        hashlib.sha1(generated.cpu().numpy().tobytes()).hexdigest()[:12],
        _ranks_agree(generated) if run.tp > 1 else None,
        run.all_reduce if run.tp > 1 else "",
        min(ttfts) * 1e3,
        max(ttfts) * 1e3,
        run.attention,
        kv / 1e9,
        run.options.pdl,
        run.options.quantize_upstream,
        run.scheme,
        *_split_fields(steps.split),
        _pdl_choices(model),
        kv_cache_dtype=run.kv_cache_dtype,
        step_spread=steps.spread,
    )  # fmt: skip


def _split_fields(split: step_split.StepSplit | None) -> tuple[float, float, float, float, tuple, float, float]:
    if split is None:
        return 0.0, 0.0, 0.0, 0.0, (), 0.0, 0.0
    ms = split.ms
    return ms["gemm"], ms["attention"], ms["rest"], split.kernels, split.top, split.bubble_ms, split.stall_ms


def _pdl_choices(model: CausalLM) -> tuple[tuple[int, bool, float, float], ...]:
    graphs = model.engine.runner.graphs
    choices = sorted(graphs.pdl_choices.items()) if graphs is not None else []
    return tuple((size, c.pdl, round(c.off_ms, 4), round(c.on_ms, 4)) for size, c in choices)


def _ranks_agree(tokens: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tokens)
    return all(torch.equal(g, tokens) for g in gathered)


def as_json(rows: Sequence[E2ERow]) -> list[dict[str, object]]:
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(r).items()} for r in rows]


def table(rows: Sequence[E2ERow]) -> str:
    head = (
        f"{'arm':<22}{'batch':>6}{'input':>7}{'TTFT ms':>10}{'spread':>8}{'prefill tok/s':>15}"
        f"{'step ms':>9}{'spread':>8}{'tok/s':>9}{'GB/s':>7}{'% floor':>9}{'peak GB':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.label:<22}{r.batch:>6}{r.input_tokens:>7}{r.ttft_ms:>10.1f}{_spread(r):>8}{r.prefill_tok_s:>15.0f}"
            f"{r.decode_step_ms:>9.3f}{100 * r.step_spread:>7.0f}%{r.decode_tok_s:>9.1f}{r.achieved_gbs:>7.0f}"
            f"{100 * r.floor_fraction:>8.0f}%"
            f"{r.peak_gb:>9.1f}"
        )
    return "\n".join(lines)


def split_table(rows: Sequence[E2ERow]) -> str:
    """Each row's decode step by kind of kernel (device ms, and its share of the measured step), the
    GPU's idle time between kernels (at their boundaries, and longer stalls), the launches a step, how
    much of the step the GPU was busy, and the largest kernels."""
    profiled = [r for r in rows if r.kernels_per_step]
    if not profiled and not cupti_available():
        return "decode step by kernel: not recorded (torch.profiler sees no GPU kernels here)"
    lines = [
        f"decode step by kernel ({step_split.STEPS} profiled steps, device ms and share of the step)",
        f"{'arm':<22}{'batch':>6}{'input':>7}{'step ms':>9}{'GEMM':>14}{'attention':>14}{'rest':>14}"
        f"{'bubbles':>14}{'stalls':>14}{'kernels':>9}{'GPU busy':>10}",
    ]
    for r in profiled:
        parts = (r.gemm_ms, r.attention_ms, r.rest_ms, r.bubble_ms, r.stall_ms)
        kinds = "".join(f"{ms:>9.3f} {100 * ms / r.decode_step_ms:>3.0f}%" for ms in parts)
        busy = (r.gemm_ms + r.attention_ms + r.rest_ms) / r.decode_step_ms
        lines.append(
            f"{r.label:<22}{r.batch:>6}{r.input_tokens:>7}{r.decode_step_ms:>9.3f}{kinds}"
            f"{r.kernels_per_step:>9.0f}{100 * busy:>9.0f}%"
        )
    missed = [f"{r.label} {r.batch}x{r.input_tokens}" for r in rows if not r.kernels_per_step]
    if missed:
        lines.append(f"not recorded for {', '.join(missed)}: the profiler saw none of their kernels")
    lines += ["largest kernels (ms a step):"] if profiled else []
    for r in profiled:
        top = ", ".join(f"{name[:48]} {ms:.3f}" for name, ms in r.top_kernels[:4])
        lines.append(f"  {r.label} {r.batch}x{r.input_tokens}: {top}")
    return "\n".join(lines)


def _spread(row: E2ERow) -> str:
    """(max - min) / median of the TTFT repeats."""
    return f"{100 * (row.ttft_max_ms - row.ttft_min_ms) / row.ttft_ms:.0f}%" if row.ttft_ms else "-"


def plot(rows: Sequence[E2ERow], path: Path, title: str) -> Path | None:
    """Decode tokens/s and TTFT per arm, one group of bars per (batch, input); None without matplotlib."""
    from fp8route.tuning.plot import pyplot, save

    plt = pyplot()
    if plt is None or not rows:
        return None
    arms = list(dict.fromkeys(r.label for r in rows))
    points = list(dict.fromkeys((r.batch, r.input_tokens) for r in rows))
    by = {(r.label, r.batch, r.input_tokens): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(points))]
        axes[0].bar(xs, [by[(arm, b, t)].decode_tok_s for b, t in points], width, label=arm)
        axes[1].bar(xs, [by[(arm, b, t)].ttft_ms for b, t in points], width, label=arm)
    for ax, label in zip(axes, ("decode tokens/s (higher is better)", "TTFT ms (lower is better)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))], [f"{b}x{t}" for b, t in points])
        ax.set_xlabel("batch x prompt tokens")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return save(fig, plt, path)


def tp_summary(rows: Sequence[E2ERow]) -> str:
    """Each sharded row against the one-rank row of the same arm, attention and shape: decode speed-up, TTFT
    speed-up, memory ratio, and whether the tokens match."""
    single = {(r.arm, r.attention, r.batch, r.input_tokens, r.round): r for r in rows if r.tp == 1}
    lines = [f"{'':<22}{'batch':>6}{'input':>7}{'decode x':>10}{'TTFT x':>8}{'mem x':>7}  tokens"]
    for r in rows:
        base = single.get((r.arm, r.attention, r.batch, r.input_tokens, r.round))
        if r.tp == 1 or base is None:
            continue
        same = "= tp1" if r.tokens_digest == base.tokens_digest else "differ from tp1"
        ranks = "ranks agree" if r.ranks_agree else "RANKS DISAGREE"
        lines.append(
            f"{r.label:<22}{r.batch:>6}{r.input_tokens:>7}{r.decode_tok_s / base.decode_tok_s:>10.2f}"
            f"{base.ttft_ms / r.ttft_ms:>8.2f}{r.peak_gb / base.peak_gb:>7.2f}  {ranks}, {same}"
        )
    return "\n".join(lines)


def _arm_shape(r: E2ERow) -> tuple[str, str, str, int, int, int, int]:
    """What a row is compared within: its checkpoint's scheme, arm, attention, ranks, shape and round."""
    return (r.scheme, r.arm, r.attention, r.tp, r.batch, r.input_tokens, r.round)


def _options(r: E2ERow) -> tuple[bool | None, bool]:
    return (r.pdl, r.quantize_upstream)


def options_summary(rows: Sequence[E2ERow]) -> str:
    """Each row against the first row of the same arm and shape, whose kernel options are each flag's
    first value: decode step and TTFT speed-up, and whether the tokens match (no option changes what
    is computed: PDL changes when kernels start, the fused SiLU and the quantizing norms round as the
    kernels they replace). Then, for each arm that measured PDL per decode graph, the graphs that kept it."""
    first: dict[tuple, E2ERow] = {}
    for r in rows:
        first.setdefault(_arm_shape(r), r)
    lines = [f"{'':<34}{'batch':>6}{'input':>7}{'decode x':>10}{'TTFT x':>8}  against, tokens"]
    for r in rows:
        base = first[_arm_shape(r)]
        if base is r:
            continue
        same = "equal" if r.tokens_digest == base.tokens_digest else "DIFFER"
        lines.append(
            f"{r.label:<34}{r.batch:>6}{r.input_tokens:>7}{base.decode_step_ms / r.decode_step_ms:>10.3f}"
            f"{base.ttft_ms / r.ttft_ms:>8.3f}  {base.label}, {same}"
        )
    measured = {(r.label, r.pdl_choices) for r in rows if r.pdl_choices}
    for label, choices in sorted(measured):
        kept = [f"{size} ({off / on:.3f}x)" for size, pdl, off, on in choices if pdl]
        lines.append(
            f"{label}: PDL kept in {len(kept)} of {len(choices)} decode graphs"
            + (f", batches {', '.join(kept)} (replay time without / with)" if kept else "")
        )
    return "\n".join(lines)


def scheme_summary(rows: Sequence[E2ERow]) -> str:
    """Each row of a channel or block checkpoint against the per-tensor one of the same arm and shape,
    and kernel options, in the same run: decode step time and TTFT as ratios (above 1: slower than
    per-tensor)."""
    tensor = {(_arm_shape(r)[1:], _options(r)): r for r in rows if r.scheme == "tensor"}
    lines = [f"{'':<30}{'batch':>6}{'input':>7}{'step / tensor':>15}{'TTFT / tensor':>15}"]
    for r in rows:
        base = tensor.get((_arm_shape(r)[1:], _options(r)))
        if base is None or r.scheme in ("tensor", "bf16"):
            continue
        lines.append(
            f"{r.label:<30}{r.batch:>6}{r.input_tokens:>7}{r.decode_step_ms / base.decode_step_ms:>15.3f}"
            f"{r.ttft_ms / base.ttft_ms:>15.3f}"
        )
    return "\n".join(lines)
