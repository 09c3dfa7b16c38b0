"""Triton, when it imports: CPU-only installs lack it, and the backends say so instead of failing."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"triton is not importable: {exc}"

__all__ = ["TRITON_IMPORT_ERROR", "tl", "triton"]
