"""Launch configurations of the decode GEMM: measured ones per device and shape, else a heuristic.

Pure Python (no triton), so planning and tests on a CPU can ask what would run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fp8route.device import DeviceInfo
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

M_MAX = 128  # decode sizes; the library GEMMs win above (benchmarks/DECODE.md)
CUDA_CORE_M_MAX = 8  # the CUDA-core kernel's FMAs grow with M; from 16 on the tensor cores win
K_ALIGN = 16  # 16-byte rows of the fp8 weight: cp.async / wgmma operand alignment
_SMEM_PER_SM = 227 * 1024  # Hopper: shared memory one SM can give its CTAs
_GROUP = 128  # the block scheme's K group: a step holds whole groups


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # weight rows per tile (wgmma M side: 64, 128 or 256)
    block_k: int
    block_m: int  # tokens per tile (wgmma N side)
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    cuda_core: bool = False  # the CUDA-core kernel (block_m <= CUDA_CORE_M_MAX) instead of wgmma
    maxnreg: int = 0  # registers per thread at most (0: the compiler's choice); fewer fit more CTAs per SM


def why_not(m_max: int, n: int, k: int) -> str | None:
    """None if the kernel supports every M in 1..m_max for an [N, K] weight, else the reason."""
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    if m_max < 1 or m_max > M_MAX:
        return f"M={m_max} is outside 1..{M_MAX}: the kernel is built for decode-sized batches"
    if k % K_ALIGN:
        return f"K={k} is not a multiple of {K_ALIGN} (16-byte fp8 weight rows)"
    if n < 1 or k < K_ALIGN:
        return f"N={n}, K={k}: empty or too small"
    if n * k >= 2**31 or m_max * max(n, k) >= 2**31:
        return f"N*K={n * k} needs 64-bit offsets, which this kernel does not use"
    return None


C = DecodeConfig
# (block_n, block_k, num_warps, num_stages) per block_m where no measured entry exists.
_DEFAULT_BLOCKS = {16: (256, 128, 8, 4), 32: (128, 128, 8, 4), 64: (128, 128, 8, 4)}
# The fastest config per M bucket, from `fp8route bench decode --sweep` (benchmarks/DECODE.md):
# (N, K) -> ((m_max, config), ...), in increasing m_max.
_H200: dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]] = {
    (6144, 4096): (  # 8B qkv (80 registers: 3 CTAs per SM instead of 2)
        (1, C(16, 2048, 1, 1, 8, 1, cuda_core=True, maxnreg=80)),
        (16, C(256, 128, 16, 4, 8, 4)),
        (32, C(256, 128, 32, 4, 8, 3)),
        (128, C(128, 64, 64, 4, 8, 6)),
    ),
    (4096, 4096): (  # 8B o
        (1, C(16, 2048, 1, 1, 8, 1, cuda_core=True)),
        (2, C(256, 128, 16, 8, 8, 4)),
        (16, C(128, 256, 16, 4, 8, 3)),
        (32, C(256, 128, 32, 8, 8, 3)),
        (128, C(128, 128, 64, 4, 8, 4)),
    ),
    (28672, 4096): (  # 8B gate_up
        (1, C(32, 512, 1, 1, 8, 1, cuda_core=True)),
        (16, C(256, 128, 16, 1, 8, 4)),
        (32, C(128, 128, 32, 1, 8, 4)),
        (128, C(256, 64, 64, 1, 8, 4)),
    ),
    (4096, 14336): (  # 8B down
        (1, C(32, 512, 1, 4, 8, 1, cuda_core=True)),
        (8, C(256, 128, 16, 8, 8, 4)),
        (16, C(128, 256, 16, 4, 8, 3)),
        (32, C(128, 128, 32, 8, 8, 4)),
        (128, C(128, 128, 64, 4, 8, 4)),
    ),
    (3072, 4096): ((1, C(16, 2048, 1, 1, 8, 1, cuda_core=True)),),  # 8B TP2 qkv
    (4096, 2048): ((1, C(16, 1024, 1, 1, 8, 1, cuda_core=True)),),  # 8B TP2 o
    (14336, 4096): ((1, C(16, 512, 1, 1, 4, 1, cuda_core=True)),),  # 8B TP2 gate_up (TP2 down: the rule)
    (1536, 4096): (  # 8B TP4 qkv
        (1, C(16, 2048, 1, 1, 8, 1, cuda_core=True)),
        (2, C(8, 512, 2, 8, 1, 3, cuda_core=True)),
        (4, C(128, 256, 16, 8, 8, 3)),
        (8, C(128, 128, 16, 11, 8, 5)),
        (16, C(128, 256, 16, 8, 8, 3)),
        (32, C(128, 256, 16, 4, 8, 3)),
        (64, C(128, 128, 16, 5, 8, 5)),
        (128, C(128, 128, 64, 8, 8, 4)),
    ),
    (4096, 1024): (  # 8B TP4 o
        (1, C(16, 1024, 1, 1, 8, 1, cuda_core=True)),
        (2, C(16, 1024, 2, 1, 8, 1, cuda_core=True)),
        (4, C(64, 128, 16, 1, 4, 6)),
        (8, C(128, 256, 16, 1, 8, 3)),
        (16, C(64, 128, 16, 1, 4, 6)),
        (64, C(128, 256, 16, 1, 8, 3)),
        (128, C(128, 128, 64, 4, 8, 4)),
    ),
    (7168, 4096): (  # 8B TP4 gate_up
        (1, C(16, 1024, 1, 1, 8, 1, cuda_core=True)),
        (16, C(256, 128, 16, 4, 8, 4)),
        (32, C(256, 128, 32, 4, 8, 3)),
        (64, C(256, 128, 32, 2, 8, 3)),
        (128, C(128, 128, 64, 2, 8, 4)),
    ),
    (4096, 3584): (  # 8B TP4 down
        (1, C(16, 512, 1, 1, 4, 3, cuda_core=True)),
        (2, C(16, 512, 2, 1, 2, 3, cuda_core=True)),
        (8, C(256, 128, 16, 7, 8, 4)),
        (16, C(128, 256, 16, 4, 8, 3)),
        (32, C(128, 128, 16, 4, 8, 5)),
        (64, C(256, 128, 32, 4, 8, 3)),
        (128, C(128, 128, 64, 4, 8, 4)),
    ),
}  # fmt: skip
# The block scheme's measured entries, as _H200 (benchmarks/scripts/block_decode_sweep.py): its per-group
# scale loads make the per-tensor scheme's tiles the wrong ones at M=1.
_H200_BLOCK: dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]] = {}
# Measured tables by device identity (the routing fingerprint's device fields): another GPU with as
# many SMs (an H100 SXM has 132 too) has other clocks and memory, so it takes the heuristic.
MEASURED: dict[
    tuple[str, tuple[int, int] | None, int, int], dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]]
] = {
    ("NVIDIA H200", (9, 0), 132, 60 * 2**20): _H200,
}
MEASURED_BLOCK: dict[
    tuple[str, tuple[int, int] | None, int, int], dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]]
] = {
    ("NVIDIA H200", (9, 0), 132, 60 * 2**20): _H200_BLOCK,
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def ctas_per_sm(block_n: int, block_k: int, block_m: int, num_stages: int) -> int:
    """CTAs of one config that fit an SM's shared memory (each stage: a weight tile and a bf16 x tile)."""
    return max(1, _SMEM_PER_SM // (num_stages * (block_n * block_k + 2 * block_k * block_m)))


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, device: DeviceInfo) -> DecodeConfig:
    """The launch configuration for one (M, N, K) on a device: the measured entry if there is one,
    else one wave.

    One wave: split K so that tiles x splits just fills every SM's CTA slots once. Every CTA then
    streams an equal share from start to end; a second, partial wave left SMs idle at the tail,
    and more, shorter CTAs paid their pipeline fill and split-K epilogue more often.
    """
    for m_max, cfg in MEASURED.get(device.identity, {}).get((n, k), ()):
        if m <= m_max:
            return cfg
    num_sms = device.sm_count or 132
    if m == 1:
        return _one_token_config(n, k, num_sms)
    block_m = block_m_for(m)
    block_n, block_k, warps, stages = _DEFAULT_BLOCKS[block_m]
    block_k = min(block_k, max(K_ALIGN, next_power_of_2(k)))
    slots = num_sms * ctas_per_sm(block_n, block_k, block_m, stages)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split = max(1, min(slots // tiles, cdiv(k, block_k)))
    return DecodeConfig(block_n, block_k, block_m, split, num_warps=warps, num_stages=stages)


def choose_block_config(m: int, n: int, k: int, device: DeviceInfo) -> DecodeConfig:
    """choose_config for 128x128 block weights (launch.block_config makes it block-legal). At M=1 the
    block kernel's per-group scale loads want their own tiles: 8 rows of two warps, 512-wide steps (four
    groups) in three stages, split in two past 16 steps (the 8B down projection), the per-tensor rule
    being a fifth slower there (benchmarks/results/h100/schemes_decode). Larger M: the per-tensor choice.
    A measured entry for the device and shape comes first."""
    for m_max, cfg in MEASURED_BLOCK.get(device.identity, {}).get((n, k), ()):
        if m <= m_max:
            return cfg
    if m > 1:
        return choose_config(m, n, k, device)
    block_k = max(_GROUP, min(512, next_power_of_2(k)))
    return DecodeConfig(8, block_k, 1, cdiv(cdiv(k, block_k), 16), num_warps=2, num_stages=3, cuda_core=True)


def _one_token_config(n: int, k: int, num_sms: int) -> DecodeConfig:
    """The CUDA-core kernel, which won at M=1 on every swept H200 shape but one (a tie): 16-row
    blocks, one warp-wide 512-byte K-step per row, split-K up to about eight CTAs per SM while every
    split keeps at least two K-steps."""
    block_k = min(512, max(K_ALIGN, next_power_of_2(k)))
    tiles, k_iters = cdiv(n, 16), cdiv(k, block_k)
    split = 1
    while tiles * split * 2 <= 8 * num_sms and k_iters // (split * 2) >= 2:
        split *= 2
    return DecodeConfig(16, block_k, 1, split, num_warps=4, num_stages=1, cuda_core=True)
