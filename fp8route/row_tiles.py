"""Row-wise products in tiles of a fixed shape, so that a row's result never depends on how many rows
share the call (the deterministic mode's GEMMs on a CPU).

A CPU GEMM library picks its kernel and blocking by the problem's shape: a lone row runs as a GEMV and
rounds differently from the same row inside a larger GEMM. Run every call as tiles of ROW_TILE rows
(the last one zero-padded), each tile the same [ROW_TILE, K] x [K, N] call, and every row goes through
the same arithmetic whatever else shares its batch. The price is a small batch's padding: a lone row
computes ROW_TILE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_TILE = 16


def by_row_tiles(fn: Callable[..., torch.Tensor], x: torch.Tensor, *per_row: torch.Tensor) -> torch.Tensor:
    """fn(x_tile, *per_row_tiles) over x [M, ...] in tiles of ROW_TILE rows, concatenated back to M
    rows. per_row: tensors with a row per row of x (per-token scales), tiled alongside; fn must
    compute each output row from its own input row alone."""
    m = x.shape[0]
    if m == 0:  # no row to keep invariant
        return fn(x, *per_row)
    pad = -m % ROW_TILE
    if pad:
        x, per_row = _pad_rows(x, pad), tuple(_pad_rows(t, pad) for t in per_row)
    tiles = [fn(x[i : i + ROW_TILE], *(t[i : i + ROW_TILE] for t in per_row)) for i in range(0, x.shape[0], ROW_TILE)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:m] if pad else out


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    # Zero rows with zero scales: their products are zeros (no division), so no NaN enters a tile.
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
