"""The paged decode kernel run by Triton's interpreter on a CPU, against the SDPA reference: a check
that needs no GPU (pip's triton; TRITON_INTERPRET=1 is set here before triton loads), on small
shapes, several block sizes, split lengths that grow with a row's length, and the fused new token.
It checked the kernel before the device did.

    pip install triton pytest   # into a CPU venv with torch
    python benchmarks/paged_decode_interpreter.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from gpu.test_decode_attention import paged  # noqa: E402

from fp8route.engine import paged_decode as da  # noqa: E402
from fp8route.engine.attention import decode_attention_torch  # noqa: E402
from fp8route.models.fused import rope, rope_into_cache  # noqa: E402
from fp8route.models.llama import LlamaConfig, rope_tables  # noqa: E402


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def check(b: int, h: int, hkv: int, d: int, s: int, lengths: list[int], page: int, split: int | None = None) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    (k_blocks, tables), (v_blocks, _) = paged(k, page), paged(v, page)
    n = torch.tensor(lengths)
    out = da.decode_attention(q, da.Pages(k_blocks, v_blocks, tables, torch.arange(b)), n, split=split)
    err = relative(out, decode_attention_torch(q, k, v, n))
    print(f"B={b} H={h} Hkv={hkv} D={d} S={s} lengths={lengths} page={page} split={split}: rel err {err:.1e}")
    assert err < 1e-4


def check_new_token(b: int = 3, h: int = 4, hkv: int = 2, d: int = 32, s: int = 512, page: int = 16) -> None:
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, 1, (h + 2 * hkv) * d, generator=g)
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor([0, 130, 511])
    cos, sin = (t[:, None] for t in rope_tables(LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, head_dim=d), pos))
    (k_blocks, tables), (v_blocks, _) = (paged(torch.randn(b, hkv, s, d, generator=g), page) for _ in range(2))
    rows = torch.arange(b)
    fused = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    out = da.decode_attention(q[:, 0], fused, pos + 1, new=da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]))
    ref = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    slots = tables[rows, pos // page].long() * page + pos % page
    rope_into_cache(k, v, cos, sin, ref.k.view(-1, hkv, d), ref.v.view(-1, hkv, d), slots)
    gathered = [x[tables[rows].long()].flatten(1, 2).transpose(1, 2) for x in (ref.k, ref.v)]
    err = relative(out, decode_attention_torch(rope(q, cos, sin)[:, :, 0], *gathered, pos + 1))
    print(f"new token fused: rel err {err:.1e}")
    assert err < 1e-4 and torch.allclose(fused.k.nan_to_num(), ref.k.nan_to_num(), atol=1e-5)


def main() -> None:
    check(1, 4, 2, 32, 512, [200], 16)
    check(2, 4, 1, 32, 1024, [1, 1000], 8, split=64)  # 16 splits at most: the long row takes longer ones
    check(3, 8, 2, 16, 256, [64, 65, 256], 16, split=64)
    check(1, 2, 1, 16, 4096, [4000], 32, split=64)
    check_new_token()
    print("OK")


if __name__ == "__main__":
    main()
