"""What the kernel tests share: float conversions under Triton's interpreter as the GPU does them."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def gpu_conversions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, fp32 -> e4m3 and fp32 -> bf16 as the GPU converts (round to nearest
    even; e4m3 saturating, as cvt.rn.satfinite, NaN kept), through torch. The interpreter's own e4m3
    conversion drops the carry of a mantissa rounded up into the next power of two and does not
    saturate, and its bf16 one truncates: its artifacts, not a kernel's. On a GPU nothing changes."""
    if torch.cuda.is_available():
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    to_fp, cast = InterpreterBuilder.create_fp_to_fp, InterpreterBuilder.cast_impl

    def through_torch(src: TensorHandle, dtype: torch.dtype, tt_dtype: object, np_dtype: type) -> TensorHandle:
        wide = torch.from_numpy(np.asarray(src.data, dtype=np.float32))
        narrow = wide.clamp(-448, 448) if dtype == torch.float8_e4m3fn else wide
        bits = narrow.to(dtype).view(torch.uint8 if np_dtype is np.uint8 else torch.int16).numpy()
        return TensorHandle(bits.view(np_dtype), tt_dtype)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if dst_type.scalar != tl.float8e4nv:
            return to_fp(self, src, dst_type, rounding_mode)
        return through_torch(src, torch.float8_e4m3fn, tl.float8e4nv, np.uint8)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return through_torch(src, torch.bfloat16, tl.bfloat16, np.uint16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast_impl)
