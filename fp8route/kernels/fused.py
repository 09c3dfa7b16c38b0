"""The decoder's elementwise steps as single Triton kernels on CUDA: RMSNorm (alone or after the
residual add), rotary embedding and SiLU-times-up, each one launch where eager torch takes six to ten.

At decode a layer's four GEMMs take a few µs each, and every other step costs a launch of about as
much: eager torch ran ~40 kernels per Llama layer, of which these fuse ~24 into 4. Each function
keeps the eager torch expression as its CPU path and as the reference the GPU tests hold the
kernel to (same fp32 arithmetic, same roundings to the activation dtype; sums may round apart).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton
from fp8route.quant import quantize_by_inverse

_HALF = (torch.bfloat16, torch.float16)


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _HALF and TRITON_IMPORT_ERROR is None and not torch.compiler.is_compiling()


@functools.cache  # one dict per width, not one per call
def _norm_meta(width: int) -> dict[str, int]:
    return {"BLOCK": triton.next_power_of_2(width), "num_warps": 4}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalized in fp32, rounded to x's dtype before the
    weight multiplies it (as Hugging Face's Llama does)."""
    if not _use_kernel(x) or x.stride(-1) != 1:
        return rms_norm_reference(x, weight, eps)
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    args = (rows, weight, out, rows.stride(0), width, eps)
    _RMS_NORM((rows.shape[0],), (x.dtype, weight.dtype, *args[3:]), args, _norm_meta(width))
    return out.reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a decoder's residual add and the norm after it in
    one pass. The sum is rounded to x's dtype before it is normalized, as the two eager steps do."""
    if not _use_kernel(x) or not (x.is_contiguous() and residual.is_contiguous()) or x.dtype != residual.dtype:
        h = x + residual
        return rms_norm(h, weight, eps), h
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    out = torch.empty_like(rows)
    total = torch.empty_like(rows)
    args = (rows, residual.reshape(-1, width), weight, out, total, width, eps)
    _ADD_RMS_NORM((rows.shape[0],), (x.dtype, weight.dtype, width, eps), args, _norm_meta(width))
    return out.reshape(x.shape), total.reshape(x.shape)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_major: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary embedding in Hugging Face's convention (the head's halves are the pairs) of x
    [B, T, H, D] (any strides, last dim contiguous) with cos/sin [T, D] or [B, T, D]; returns
    [B, H, T, D], the layout attention reads: contiguous, or with token_major a view of [B, T, H, D]
    storage (FlashInfer's layout) on the kernel's path. out: [B, H, T, D] to write instead (any
    strides, last dim contiguous), returned."""
    b, t, heads, dim = x.shape
    half = dim // 2
    if not _use_kernel(x) or x.stride(-1) != 1 or half & (half - 1) or cos.stride(-1) != 1:
        if cos.dim() == 3:  # per row: [B, T, D] -> [B, 1, T, D], broadcast over the heads
            cos, sin = cos[:, None], sin[:, None]
        rotated = rope_reference(x.transpose(1, 2), cos, sin)
        return rotated if out is None else out.copy_(rotated)
    if out is not None:
        assert out.shape == (b, heads, t, dim) and out.stride(-1) == 1, "rope: out is [B, H, T, D], unit stride on D"
    elif token_major:
        out = torch.empty((b, t, heads, dim), dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty((b, heads, t, dim), dtype=x.dtype, device=x.device)
    per_row = cos.dim() == 3
    args = (
        x, cos, sin, out, t,
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0) if per_row else 0, cos.stride(-2),
        out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    # The token count and the strides that follow it change with every prefill: keyed by class (the
    # head size, HALF, is told apart by the launcher, which keys by meta too).
    key = (x.dtype, cos.dtype, sin.dtype, *int_key(*args[4:]))
    _ROPE((b * t, heads), key, args, {"HALF": half, "num_warps": 1})
    return out


def rope_into_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slots: torch.Tensor,
    scales: tuple[float, float] | None = None,
    staged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Decode's new keys and values into the cache in one launch: row b's k [B, 1, Hkv, D] rotated
    with its cos/sin [B, 1, D] and its v, written at slot slots[b] of k_slots/v_slots [S, Hkv, D]
    (a paged cache viewed by slot). (Eager torch: the rotation's kernels, then an index for each write.)
    With scales (k_scale, v_scale) the cache is float8_e4m3fn: the rotated key, rounded to k's dtype,
    and v are stored as x / scale, saturated (fp8route.engine.kv_quant). staged: k and v [B, Hkv, D]
    (unit stride on D, k's dtype) that also get row b's key and value as a read of the cache gives them
    back (in an fp8 cache, the stored e4m3 value times its scale)."""
    b, _, heads, dim = k.shape
    half = dim // 2
    usable = _use_kernel(k) and k.stride(-1) == v.stride(-1) == 1 and k_slots.stride(-1) == v_slots.stride(-1) == 1
    if staged is not None:
        usable = usable and staged[0].stride(-1) == staged[1].stride(-1) == 1
    if not usable or half & (half - 1) or cos.stride(-1) != 1:
        k_new, v_new = rope(k, cos, sin)[:, :, 0], v[:, 0]
        if scales is not None:
            k_new, v_new = quantize_by_inverse(k_new, scales[0]), quantize_by_inverse(v_new, scales[1])
        k_slots[slots] = k_new
        v_slots[slots] = v_new
        if staged is not None:
            for out, x, scale in zip(staged, (k_new, v_new), scales or (None, None), strict=True):
                out.copy_(x if scale is None else x.float() * scale)
        return
    k_scale, v_scale = scales if scales is not None else (1.0, 1.0)
    k_out, v_out = staged if staged is not None else (k_slots, v_slots)  # unread without STAGE
    args = (
        k, v, cos, sin, k_slots, v_slots, slots, k_out, v_out,
        k.stride(0), k.stride(2), v.stride(0), v.stride(2), cos.stride(0),
        k_slots.stride(0), k_slots.stride(1), v_slots.stride(0), v_slots.stride(1),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        1.0 / k_scale, 1.0 / v_scale, k_scale, v_scale,
    )  # fmt: skip
    key = (*(a.dtype for a in args[:9]), *args[9:-4])
    meta = {"HALF": half, "FP8": scales is not None, "STAGE": staged is not None, "num_warps": 1}
    _ROPE_STORE((b, heads), key, args, meta)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * width] holding gate then up, each rounded to the
    activation dtype as eager torch rounds them."""
    if not _use_kernel(gate_up) or gate_up.stride(-1) != 1:
        gate, up = gate_up.split(width, dim=-1)
        return F.silu(gate) * up
    rows = gate_up.reshape(-1, 2 * width)
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    args = (rows, out, rows.stride(0), width)
    _SILU_MUL((rows.shape[0], triton.cdiv(width, _SILU_BLOCK)), (gate_up.dtype, *args[2:]), args, _SILU_META)
    return out.reshape(*gate_up.shape[:-1], width)


if triton is not None:
    from fp8route.kernels.pdl import wait_for_inputs

    @triton.jit
    def normalize_and_store(h, w_ptr, out_ptr, offs, mask, width, eps):
        """out = w * (h / rms(h)) for one row h (fp32), normalized and weighted in the out dtype's roundings."""
        inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / width + eps)
        normed = (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_row, width, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2^31 in a large prefill
        offs = tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(x_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
        normalize_and_store(x, w_ptr, out_ptr + row * width, offs, mask, width, eps)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, width, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
    ):
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2^31 in a large prefill
        offs = tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(x_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * width + offs, total, mask=mask)
        normalize_and_store(total.to(tl.float32), w_ptr, out_ptr + row * width, offs, mask, width, eps)

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr, T,
        sxb, sxt, sxh, scb, sct, sob, soh, sot,
        HALF: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        bt = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        b = bt // T
        t = bt % T
        offs = tl.arange(0, HALF)
        x_row = x_ptr + b * sxb + t * sxt + h * sxh
        x1 = tl.load(x_row + offs).to(tl.float32)
        x2 = tl.load(x_row + HALF + offs).to(tl.float32)
        table = b * scb + t * sct
        c1 = tl.load(cos_ptr + table + offs)
        c2 = tl.load(cos_ptr + table + HALF + offs)
        s1 = tl.load(sin_ptr + table + offs)
        s2 = tl.load(sin_ptr + table + HALF + offs)
        out_row = out_ptr + b * sob + h * soh + t * sot
        tl.store(out_row + offs, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
        tl.store(out_row + HALF + offs, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _rope_store_kernel(
        k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, ko_ptr, vo_ptr,
        skb, skh, svb, svh, scb, skcs, skch, svcs, svch, skob, skoh, svob, svoh, k_inv, v_inv, k_scale, v_scale,
        HALF: tl.constexpr, FP8: tl.constexpr, STAGE: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        k_row = k_ptr + b * skb + h * skh
        k1 = tl.load(k_row + offs).to(tl.float32)
        k2 = tl.load(k_row + HALF + offs).to(tl.float32)
        c1 = tl.load(cos_ptr + b * scb + offs)
        c2 = tl.load(cos_ptr + b * scb + HALF + offs)
        s1 = tl.load(sin_ptr + b * scb + offs)
        s2 = tl.load(sin_ptr + b * scb + HALF + offs)
        kc_row = kc_ptr + slot * skcs + h * skch
        v_row = v_ptr + b * svb + h * svh
        vc_row = vc_ptr + slot * svcs + h * svch
        ko_row = ko_ptr + b * skob + h * skoh
        vo_row = vo_ptr + b * svob + h * svoh
        if FP8:  # rounded to k's dtype first, as the torch path's rope() rounds it
            r1 = (k1 * c1 - k2 * s1).to(k_ptr.dtype.element_ty).to(tl.float32) * k_inv
            r2 = (k2 * c2 + k1 * s2).to(k_ptr.dtype.element_ty).to(tl.float32) * k_inv
            q1 = tl.minimum(tl.maximum(r1, -448.0), 448.0).to(kc_ptr.dtype.element_ty)
            q2 = tl.minimum(tl.maximum(r2, -448.0), 448.0).to(kc_ptr.dtype.element_ty)
            tl.store(kc_row + offs, q1)
            tl.store(kc_row + HALF + offs, q2)
            v1 = tl.load(v_row + offs).to(tl.float32) * v_inv
            v2 = tl.load(v_row + HALF + offs).to(tl.float32) * v_inv
            w1 = tl.minimum(tl.maximum(v1, -448.0), 448.0).to(vc_ptr.dtype.element_ty)
            w2 = tl.minimum(tl.maximum(v2, -448.0), 448.0).to(vc_ptr.dtype.element_ty)
            tl.store(vc_row + offs, w1)
            tl.store(vc_row + HALF + offs, w2)
            if STAGE:  # what a read of the cache gives back
                tl.store(ko_row + offs, (q1.to(tl.float32) * k_scale).to(ko_ptr.dtype.element_ty))
                tl.store(ko_row + HALF + offs, (q2.to(tl.float32) * k_scale).to(ko_ptr.dtype.element_ty))
                tl.store(vo_row + offs, (w1.to(tl.float32) * v_scale).to(vo_ptr.dtype.element_ty))
                tl.store(vo_row + HALF + offs, (w2.to(tl.float32) * v_scale).to(vo_ptr.dtype.element_ty))
        else:
            r1 = (k1 * c1 - k2 * s1).to(kc_ptr.dtype.element_ty)
            r2 = (k2 * c2 + k1 * s2).to(kc_ptr.dtype.element_ty)
            v1 = tl.load(v_row + offs)
            v2 = tl.load(v_row + HALF + offs)
            tl.store(kc_row + offs, r1)
            tl.store(kc_row + HALF + offs, r2)
            tl.store(vc_row + offs, v1)
            tl.store(vc_row + HALF + offs, v2)
            if STAGE:
                tl.store(ko_row + offs, r1.to(ko_ptr.dtype.element_ty))
                tl.store(ko_row + HALF + offs, r2.to(ko_ptr.dtype.element_ty))
                tl.store(vo_row + offs, v1.to(vo_ptr.dtype.element_ty))
                tl.store(vo_row + HALF + offs, v2.to(vo_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_row, width, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2^31 in a large prefill
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < width
        gate = tl.load(x_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_row + width + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * width + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    # Keys name the dtypes and integer arguments each launch specializes on (launcher.py).
    _RMS_NORM = DirectLauncher(_rms_norm_kernel, pointers=3, pdl=True)
    _ADD_RMS_NORM = DirectLauncher(_add_rms_norm_kernel, pointers=5, pdl=True)
    _ROPE = DirectLauncher(_rope_kernel, pointers=4, pdl=True)
    _ROPE_STORE = DirectLauncher(_rope_store_kernel, pointers=9, pdl=True)  # the scales: fp32 arguments
    _SILU_MUL = DirectLauncher(_silu_mul_kernel, pointers=2, pdl=True)
    _SILU_BLOCK = 1024
    _SILU_META = {"BLOCK": _SILU_BLOCK, "num_warps": 4}
