"""Decode-size static per-tensor FP8 linear on mma.sync, compiled at run time by NVRTC (fp8_mma.cu).

    out = (q(x) @ w.T) * input_scale * weight_scale + bias,   q(x) = e4m3(clamp(x / input_scale, +-448))

The Triton kernels in fp8_gemv.py stage every weight tile through shared memory and wait for it at
a CTA-wide barrier; at M 16-64 that left them at 32-37% of DRAM peak where cuBLASLt pulls 50-57%
(benchmarks/DECODE.md). This kernel loads the weight straight into the MMA's A registers (fp8_mma.cu
says how a 128-bit load can feed two k32 MMAs), so nothing in its main loop waits on other warps.
CUDA because Triton decides the register layout of a load itself; NVRTC because it ships with
PyTorch's CUDA builds, so no compiler is needed on the user's machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import torch

from fp8route.errors import Fp8InputError, Fp8TypeError

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)
M_MAX = 64  # 8 token tiles of 8: the accumulators fill the registers beyond
CHUNK = 64  # bytes of K per step of a row's 4 lanes (fp8_mma.cu)
ROW_ALIGN = 16  # 16-byte loads of x and weight rows
_SMEM_MAX = 226 * 1024  # of the 227 KB a Hopper CTA may opt into, leaving room for static shared memory
_X_MODES = {torch.bfloat16: 0, torch.float16: 1, FP8: 2}


@dataclass(frozen=True)
class MmaConfig:
    row_groups: int  # 64-row groups per warpgroup: one x tile in shared memory serves them all
    warpgroups: int  # per CTA, each on its own rows; all share the CTA's quantized x slice
    unroll: int  # 64-byte K chunks per load batch; two batches are in flight
    split_k: int  # CTAs along K

    @property
    def rows_per_cta(self) -> int:
        return 64 * self.row_groups * self.warpgroups


def why_not(m_max: int, n: int, k: int, capability: tuple[int, int] | None = None) -> str | None:
    """None if fp8_mma runs every M in 1..m_max for an [N, K] weight, else the reason."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"needs torch.cuda._compile_kernel (NVRTC, torch >= 2.8); this is torch {torch.__version__}"
    if capability is not None and capability != (9, 0):
        return f"built for Hopper's wgmma (SM90), this GPU is SM{capability[0]}{capability[1]}"
    if m_max < 1 or m_max > M_MAX:
        return f"M={m_max} is outside 1..{M_MAX}"
    if k % CHUNK:
        return f"K={k} is not a multiple of {CHUNK}"
    if n < 1:
        return f"N={n}: empty"
    if n * k >= 2**31 or m_max * max(n, k) >= 2**31:
        return f"N*K={n * k} needs 64-bit offsets"
    return None


def smem_bytes(m: int, chunks_per_split: int) -> int:
    """The quantized x slice of one CTA: M padded to 8 tokens, times its K."""
    return -(-m // 8) * 8 * chunks_per_split * CHUNK


def default_config(m: int, n: int, k: int, num_sms: int) -> MmaConfig:
    """Before a sweep: one 64-row group per warpgroup, one warpgroup per CTA, and split-K until the
    CTAs fill every SM about four times over, within the shared memory."""
    cfg = MmaConfig(row_groups=1, warpgroups=1, unroll=4, split_k=1)
    tiles, chunks = -(-n // cfg.rows_per_cta), k // CHUNK
    split = 1
    while tiles * split * 2 <= 4 * num_sms and chunks // (split * 2) >= 2 * cfg.unroll:
        split *= 2
    while smem_bytes(m, -(-chunks // split)) > _SMEM_MAX // 2 and split < chunks:
        split *= 2
    return MmaConfig(cfg.row_groups, cfg.warpgroups, cfg.unroll, split)


def wgmma_k32(nt: int) -> str:
    """The specialization of fp8_mma.cu's wgmma_k32 for 8 * nt tokens: one asm statement whose operand
    list holds the 4 * nt accumulators."""
    n_acc = 4 * nt
    d = ", ".join(f"%{i}" for i in range(n_acc))
    a = ", ".join(f"%{n_acc + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n_acc))
    return (
        f"template <> __device__ __forceinline__ void wgmma_k32<{nt}>(float (&d)[{n_acc}], "
        "u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {\n"
        f'    asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{n_acc + 5}, 0; '
        f'wgmma.mma_async.sync.aligned.m64n{8 * nt}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, %{n_acc + 4}, p, 1, 1; }}"\n'
        f"        : {outs}\n"
        '        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));\n'
        "}\n"
    )


@functools.cache
def _source() -> str:
    text = resources.files("fp8route.kernels").joinpath("fp8_mma.cu").read_text()
    return text.replace("WGMMA_SPECIALIZATIONS", "".join(wgmma_k32(nt) for nt in range(1, M_MAX // 8 + 1)))


@functools.cache
def _kernel(nt: int, cfg: MmaConfig, x_mode: int, out_bf16: bool, has_bias: bool, device_index: int):  # noqa: ANN202
    params = (nt, cfg.row_groups, cfg.warpgroups, cfg.unroll, x_mode, int(out_bf16), int(has_bias))
    name = f"fp8_wgmma_gemv<{', '.join(map(str, params))}>"
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(_source(), name, compute_capability="90a")
        kernel.set_shared_memory_config(_SMEM_MAX)
    return kernel


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
          bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise Fp8InputError(f"fp8_mma: x must be [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.dtype != FP8:
        raise Fp8TypeError(f"fp8_mma: weight must be float8_e4m3fn, got {weight.dtype}")
    if x.dtype not in _X_MODES:
        raise Fp8TypeError(f"fp8_mma: x must be bfloat16, float16 or float8_e4m3fn, got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise Fp8TypeError(f"fp8_mma: out_dtype must be bfloat16 or float16, got {out_dtype}")
    for name, s in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != weight.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise Fp8InputError(f"fp8_mma: {name} must be one fp32 value on {weight.device}, got {got}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != out_dtype or not bias.is_contiguous()):
        raise Fp8InputError(f"fp8_mma: bias must be a contiguous [{weight.shape[0]}] {out_dtype} tensor")
    if not weight.is_contiguous():
        raise Fp8InputError("fp8_mma: weight must be contiguous")
    reason = why_not(x.shape[0], weight.shape[0], weight.shape[1])
    if reason is not None:
        raise Fp8InputError(f"fp8_mma: {reason}")


def fp8_mma(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: MmaConfig | None = None,
) -> torch.Tensor:
    """(q(x) @ weight.T) * input_scale * weight_scale + bias for x [M, K] (bf16/fp16, or e4m3 quantized
    with input_scale) and a contiguous e4m3 weight [N, K]. No host sync; graph-safe once the shape and
    config ran eagerly (compilation and the split-K counters happen on first use). Deterministic."""
    check(x, weight, weight_scale, input_scale, bias, out_dtype)
    return launch(x, weight, weight_scale, input_scale, bias, out_dtype, out=out, config=config)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: MmaConfig | None = None,
) -> torch.Tensor:
    """fp8_mma without the argument checks (the plan vetted the layer, forward checked x)."""
    from fp8route.kernels.fp8_gemv import _counters

    m, k = x.shape
    n = weight.shape[0]
    device_index = weight.device.index or 0
    cfg = config or default_config(m, n, k, _num_sms(device_index))
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % ROW_ALIGN or x.data_ptr() % ROW_ALIGN:
        x = x.contiguous() if x.data_ptr() % ROW_ALIGN == 0 else x.clone()
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise Fp8InputError(f"fp8_mma: out must be [{m}, {n}] {out_dtype} with contiguous rows")

    chunks = k // CHUNK
    per_split = -(-chunks // max(1, min(cfg.split_k, chunks)))
    split = -(-chunks // per_split)  # no empty splits
    tiles = -(-n // cfg.rows_per_cta)
    smem = smem_bytes(m, per_split)
    if smem > _SMEM_MAX:
        raise Fp8InputError(f"fp8_mma: {cfg} needs {smem} bytes of shared memory at M={m}; split K further")
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device, tiles) if split > 1 else out
    kernel = _kernel(-(-m // 8), cfg, _X_MODES[x.dtype], out_dtype == torch.bfloat16, bias is not None, device_index)
    args = [x, weight, out, bias if bias is not None else out, ws, cnt, weight_scale, input_scale,
            m, n, k, x.stride(0), out.stride(0), per_split]  # fmt: skip
    kernel(grid=(split, tiles, 1), block=(cfg.warpgroups * 128, 1, 1), args=args, shared_mem=smem)
    return out
