"""Decode-size FP8 linears on one GPU: fp8_gemv's fused-quant split-K kernels against cuBLASLt and CUTLASS.

Arms per (N, K, M), all timed with fp8route.tuning.timing (CUDA events, cold L2 by rotating operand
copies, two reps, the arms taking turns):
  ours          fp8_gemv on bf16 x (quantization fused)
  ours_prequant fp8_gemv on an already-quantized x (GEMM only)
  cublas+quant  one quantization kernel + torch._scaled_mm per-tensor (cuBLASLt)
  cublas        torch._scaled_mm per-tensor on quantized x (GEMM only)
  rowwise+quant one quantization kernel + torch._scaled_mm with (M,1)/(1,N) scales (CUTLASS)
With graph timing every arm is also timed inside one CUDA graph per arm (the rotating copies back to
back, as a decode step replays them). A sweep times every candidate configuration of ours too and keeps
the best as `ours_best`: how the per-GPU table of fp8_gemv's configurations is made.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.decode_gemm import configs

FP8 = torch.float8_e4m3fn
Call = Callable[[], torch.Tensor]  # one timed call of an arm
SHAPES = {  # name: (N, K), Llama-3.1-8B's projections per tensor-parallel rank
    "tp1_qkv": (6144, 4096), "tp1_o": (4096, 4096), "tp1_gate_up": (28672, 4096), "tp1_down": (4096, 14336),
    "tp2_qkv": (3072, 4096), "tp2_o": (4096, 2048), "tp2_gate_up": (14336, 4096), "tp2_down": (4096, 7168),
    "tp4_qkv": (1536, 4096), "tp4_o": (4096, 1024), "tp4_gate_up": (7168, 4096), "tp4_down": (4096, 3584),
}  # fmt: skip
MS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_MS = (1, 2, 4, 8, 16)
# (block_n, block_k, num_stages, num_warps) per block_m; each compiles for sm_90 in shared memory for one
# or two CTAs per SM (cuobjdump --dump-resource-usage; spills not checked).
SWEEP_BLOCKS = {
    16: ((256, 128, 4, 8), (128, 256, 3, 8), (128, 128, 5, 8), (64, 128, 6, 4), (128, 256, 2, 8), (256, 128, 2, 8),
         (256, 256, 2, 8), (128, 128, 3, 4), (64, 256, 3, 4), (128, 512, 2, 8)),
    32: ((128, 128, 4, 8), (64, 256, 4, 8), (256, 128, 3, 8)),
    64: ((128, 64, 6, 8), (128, 128, 4, 8), (256, 64, 4, 8)),
}  # fmt: skip
# The CUDA-core kernel, M <= 8: (block_n, block_k, num_warps, num_stages[, maxnreg]). block_k 512 puts a
# warp's 32 lanes along K, so each row's sum costs 5 shuffles; fewer warps per row block re-quantize x
# less often; num_stages > 1 stages weight tiles by cp.async.
CUDA_CORE_BLOCKS = (
    (16, 512, 4, 1), (16, 512, 4, 3), (32, 512, 4, 3), (16, 512, 1, 3), (16, 512, 2, 3), (32, 512, 2, 3),
    (64, 512, 4, 3), (8, 512, 1, 3), (16, 1024, 2, 3), (64, 256, 4, 3), (128, 64, 4, 3),
)  # fmt: skip
ARM_ORDER = ("ours", "ours_best", "ours_prequant", "cublas+quant", "cublas", "rowwise+quant")


@dataclass(frozen=True)
class DecodeBenchSpec:
    """What one run times: shapes, M values, repeats, and the sweep (empty sweep_ms: no sweep)."""

    shapes: tuple[str, ...] = tuple(SHAPES)
    ms: tuple[int, ...] = MS
    repeats: int = 30
    graph: bool = False
    graph_replays: int = 10
    sweep_ms: tuple[int, ...] = ()
    sweep_kinds: str = "wgmma"
    sweep_repeats: int = 20
    sweep_block_ms: tuple[int, ...] = ()
    cuda_core_blocks: tuple[tuple[int, ...], ...] = CUDA_CORE_BLOCKS


def parse_blocks(text: str) -> tuple[tuple[int, ...], ...]:
    """'16x512x4x1,16x2048x8x1x64' as CUDA-core blocks: block_n x block_k x warps x stages [x maxnreg]."""
    blocks = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split("x")
        if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise Fp8InputError(f"--cuda-core-blocks: {item!r} is not BLOCK_NxBLOCK_KxWARPSxSTAGES[xMAXNREG]")
        blocks.append(tuple(int(p) for p in parts))
    return tuple(blocks)


def check_spec(spec: DecodeBenchSpec) -> None:
    """Refuse what the run could not do, before any GPU work."""
    unknown = [s for s in spec.shapes if s not in SHAPES]
    if unknown:
        raise Fp8InputError(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if not spec.ms or any(m < 1 or m > configs.M_MAX for m in spec.ms):
        raise Fp8InputError(f"--ms: every M must be in 1..{configs.M_MAX} (decode sizes), got {list(spec.ms)}")
    kinds = set(spec.sweep_kinds.split(","))
    if not kinds <= {"wgmma", "cuda_core"}:
        raise Fp8InputError(f"--sweep-kinds: {spec.sweep_kinds!r}; known: wgmma, cuda_core (comma-separated)")
    bad = [b for b in spec.sweep_block_ms if b not in SWEEP_BLOCKS]
    if bad:
        raise Fp8InputError(f"--sweep-block-ms: {bad}; the wgmma token tiles are {', '.join(map(str, SWEEP_BLOCKS))}")


def _cuda_core_configs(m: int, n: int, k: int, num_sms: int, blocks: tuple[tuple[int, ...], ...]) -> list:
    out = []
    block_m = 1 << (m - 1).bit_length()
    for block_n, block_k, warps, stages, *maxnreg in blocks:
        k_iters, tiles = k // block_k, -(-n // block_n)
        for split in (1, 2, 3, 4, 6, 7, 8, 12, 14, 16):
            if k_iters % split == 0 and (split == 1 or num_sms // 2 <= tiles * split <= 16 * num_sms):
                out.append(configs.DecodeConfig(block_n, block_k, block_m, split, warps, stages, True, *maxnreg))
    return out


def _wgmma_configs(m: int, n: int, k: int, num_sms: int, block_ms: tuple[int, ...]) -> list:
    out = []
    own = configs.block_m_for(m)
    for block_m in sorted({own, *(b for b in block_ms if b < own)}):
        for block_n, block_k, stages, warps in SWEEP_BLOCKS[block_m]:
            k_iters = k // block_k
            slots = num_sms * configs.ctas_per_sm(block_n, block_k, block_m, stages)
            tiles = -(-n // block_n) * -(-m // block_m)
            for split in range(1, min(32, k_iters) + 1):
                uneven = k_iters % split != 0
                if uneven and (block_m > 16 or -(-k_iters // split) * (split - 1) >= k_iters):
                    continue  # uneven splits only at decode sizes, and none that leave a split empty
                if split == 1 or slots // 2 <= tiles * split <= 3 * slots:
                    out.append(configs.DecodeConfig(block_n, block_k, block_m, split, warps, stages))
    return out


def sweep_configs(m: int, n: int, k: int, num_sms: int, spec: DecodeBenchSpec) -> list[configs.DecodeConfig]:
    """The configurations to time at one (M, N, K). A wgmma token tile below M's own runs M in several
    tiles that share each weight tile through L2."""
    out = []
    if "cuda_core" in spec.sweep_kinds and m <= configs.CUDA_CORE_M_MAX:
        out += _cuda_core_configs(m, n, k, num_sms, spec.cuda_core_blocks)
    if "wgmma" in spec.sweep_kinds:
        out += _wgmma_configs(m, n, k, num_sms, spec.sweep_block_ms)
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


class Operands:
    """Rotating copies of one layer's operands (weights together > 3x L2) at the largest M."""

    def __init__(self, n: int, k: int, m_max: int, gen: torch.Generator):
        from fp8route.kernels.quantize import quantize_fp8
        from fp8route.tuning.timing import copies_for

        self.copies = copies_for(n * k)
        self.s_in = torch.tensor(4.0 / 448, device="cuda")  # x ~ N(0,1): |x| <= 4 sigma maps to 448
        self.s_w = torch.tensor(1.0 / 448, device="cuda")
        self.w = [
            (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8) for _ in range(self.copies)
        ]
        self.x = [torch.randn(m_max, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(self.copies)]
        self.xq = [quantize_fp8(x, self.s_in) for x in self.x]
        self.rows_in = self.s_in.expand(m_max, 1).contiguous()
        self.cols_w = self.s_w.expand(1, n).contiguous()

    def reference(self, m: int) -> torch.Tensor:
        q = (self.x[0][:m].float() / self.s_in).clamp(-448, 448).to(FP8)
        return (q.float().double() @ self.w[0].float().double().T) * self.s_in.double() * self.s_w.double()

    def ours(self, m: int, cfg: configs.DecodeConfig | None, prequant: bool = False) -> list[Call]:
        from fp8route.kernels.decode_gemm.launch import decode_gemm

        xs = self.xq if prequant else self.x
        return [
            functools.partial(decode_gemm, xs[i][:m], self.w[i], self.s_w, self.s_in, None, torch.bfloat16, config=cfg)
            for i in range(self.copies)
        ]

    def arms(self, m: int) -> dict[str, list[Call]]:
        from fp8route.kernels.quantize import quantize_fp8

        w, x, xq, s_in, s_w = self.w, [t[:m] for t in self.x], [t[:m] for t in self.xq], self.s_in, self.s_w

        def scaled_mm(i: int, quantize: bool, x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
            x_i = quantize_fp8(x[i], s_in) if quantize else xq[i]
            return torch._scaled_mm(x_i, w[i].t(), x_scale, w_scale, out_dtype=torch.bfloat16)

        def arm(quantize: bool, x_scale: torch.Tensor, w_scale: torch.Tensor) -> list[Call]:
            return [functools.partial(scaled_mm, i, quantize, x_scale, w_scale) for i in range(self.copies)]

        return {
            "ours": self.ours(m, None),
            "ours_prequant": self.ours(m, None, prequant=True),
            "cublas+quant": arm(True, s_in, s_w),
            "cublas": arm(False, s_in, s_w),
            "rowwise+quant": arm(True, self.rows_in[:m], self.cols_w),
        }


@dataclass
class DecodeBenchResult:
    """The JSON `bench decode` writes: per (shape, M, arm, timing) one row, and the sweep's rows."""

    fingerprint: dict
    copy_gbs: float
    empty_kernel_us: float
    empty_kernel_graph_us: float
    command: str
    rows: list[dict] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__, indent=1))


def _best_config(ops: Operands, name: str, n: int, k: int, m: int, ref: torch.Tensor, spec: DecodeBenchSpec,
                 num_sms: int, result: DecodeBenchResult) -> tuple[configs.DecodeConfig | None, float]:  # fmt: skip
    """Time every candidate config at (shape, M), one call set each; the fastest correct one."""
    from fp8route.tuning.timing import time_cold

    best_cfg, best_us = None, float("inf")
    for cfg in sweep_configs(m, n, k, num_sms, spec):
        try:
            calls = ops.ours(m, cfg)
            err = rel_err(calls[0](), ref)
            us = statistics.median(time_cold(calls, repeats=spec.sweep_repeats, warmup=1))
        except Exception as exc:  # noqa: BLE001 (e.g. out of shared memory: a row of the log, not the end)
            print(f"  {cfg} failed: {exc!r}"[:300], flush=True)
            continue
        result.sweep.append({"shape": name, "n": n, "k": k, "m": m, **cfg.__dict__, "us": us, "rel_err": err})
        if err < 2e-2 and us < best_us:
            best_cfg, best_us = cfg, us
    return best_cfg, best_us


def _time_point(ops: Operands, name: str, n: int, k: int, m: int, spec: DecodeBenchSpec, num_sms: int,
                result: DecodeBenchResult) -> None:  # fmt: skip
    """Every arm at one (shape, M): checked against the fp64 product, then timed; rows into result."""
    from fp8route.device import DeviceInfo
    from fp8route.tuning.timing import time_arms, time_graph

    t0, ref = time.time(), ops.reference(m)
    heuristic = configs.choose_config(m, n, k, DeviceInfo.of("cuda"))
    best_cfg, best_us = (None, float("inf"))
    if m in spec.sweep_ms:
        best_cfg, best_us = _best_config(ops, name, n, k, m, ref, spec, num_sms, result)
    arms = ops.arms(m) | ({"ours_best": ops.ours(m, best_cfg)} if best_cfg is not None else {})
    errs = {arm: rel_err(calls[0](), ref) for arm, calls in arms.items()}
    timings = {"events": time_arms(arms, repeats=spec.repeats)}
    if spec.graph:
        timings["graph"] = time_arms(arms, repeats=spec.graph_replays, timer=time_graph)
    nbytes = n * k + m * k * 2 + m * n * 2
    floor_us = nbytes / (result.copy_gbs * 1e3)
    for mode, timed in timings.items():
        for arm, t in timed.items():
            cfg = (best_cfg if arm == "ours_best" else heuristic).__dict__ if arm.startswith("ours") else None
            result.rows.append({
                "shape": name, "n": n, "k": k, "m": m, "arm": arm, "timing": mode, "median_us": t.median_us,
                "rep_medians_us": list(t.rep_medians_us), "spread": t.spread, "gbs": nbytes / (t.median_us * 1e3),
                "pct_copy_bw": 100 * floor_us / t.median_us, "floor_us": floor_us, "rel_err": errs[arm], "config": cfg,
            })  # fmt: skip
    us = {arm: t.median_us for arm, t in timings["events"].items()}
    best = f" best {best_us:.2f} {best_cfg}" if best_cfg else ""
    times = " ".join(f"{a} {v:.2f}" for a, v in us.items())
    print(
        f"{name:12s} M={m:4d} {times} floor {floor_us:.2f}{best} err ours {errs['ours']:.1e} [{time.time() - t0:.1f}s]"
    )


def run(spec: DecodeBenchSpec, out: Path, command: str) -> DecodeBenchResult:
    """Time every arm at every (shape, M) of the spec; the JSON is rewritten after each shape, so a run
    cut short keeps what it measured."""
    from fp8route.routing.fingerprint import Fingerprint
    from fp8route.tuning.timing import copy_bandwidth_gbs, time_cold, time_graph

    device = Fingerprint.of("cuda")
    fingerprint = device.to_json()
    copy_gbs = copy_bandwidth_gbs()
    # What an empty kernel costs through the same timing: launch and event overhead, no work.
    empty_us = statistics.median(time_cold([lambda: torch.cuda._sleep(0)], repeats=50))
    empty_graph_us = statistics.median(time_graph([lambda: torch.cuda._sleep(0)] * 50, repeats=10))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; empty kernel {empty_us:.2f} µs, in a graph {empty_graph_us:.2f} µs")
    result = DecodeBenchResult(fingerprint, copy_gbs, empty_us, empty_graph_us, command)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in spec.shapes:
        n, k = SHAPES[name]
        ops = Operands(n, k, max(spec.ms), gen)
        for m in spec.ms:
            _time_point(ops, name, n, k, m, spec, device.sm_count, result)
        del ops
        torch.cuda.empty_cache()
        result.write(out / "decode_bench.json")
    return result
