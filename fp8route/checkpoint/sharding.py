"""What a tensor-parallel rank reads of each linear's weight scale: the part that scales the part of the
weight it reads (fp8route.models.parallel.Slicer says which rows or columns of each weight).

- tensor: the one value, whole;
- channel: the weight's rows for a column-parallel layer (q/k/v, gate/up, a vocabulary-split lm_head);
  whole for a row-parallel one (o, down), whose every output row stays on every rank;
- block: rows / 128 (column-parallel) or columns / 128 (row-parallel). A rank's part must then be whole
  blocks: a split that would cut a 128-row or 128-column block is refused before any tensor is read,
  naming the layer and the size. The check is on the size every rank reads, not on this rank's start,
  so every rank refuses alike (one that went on would wait forever for the others).
"""

from __future__ import annotations

from fp8route.checkpoint.layout import Layout, LinearRecord
from fp8route.checkpoint.shards import Index, Slices
from fp8route.errors import CheckpointError
from fp8route.schemes import BLOCK, cdiv

_DIMS = ("output rows (N)", "input columns (K)")


class ScaleSlices:
    """slices, with each sharded linear's weight scale read as the part its weight's part needs."""

    def __init__(self, slices: Slices, lay: Layout) -> None:
        self.slices = slices
        self.scales: dict[str, Index | None] = {}
        for record in lay.linears.values():
            index = slices.get(record.weight.name)
            scale = record.parts.get(lay.scheme.scale_name)
            if index is not None and scale is not None:
                self.scales[scale.name] = scale_index(lay, record, index)

    def get(self, name: str, /) -> Index | None:
        if name in self.scales:
            return self.scales[name]
        return self.slices.get(name)


def scale_index(lay: Layout, record: LinearRecord, index: Index) -> Index | None:
    """The part of record's weight scale that goes with the part `index` of its weight ((rows,) or
    (all rows, columns)); None: the whole scale."""
    scheme = lay.scheme.fp8_scheme
    dim, piece = len(index) - 1, index[-1]
    if scheme == "tensor" or (scheme == "channel" and dim == 1):
        return None
    if scheme == "channel":
        return (piece,)
    size = record.weight.shape[dim]
    start, stop = piece.start or 0, size if piece.stop is None else piece.stop
    if start % BLOCK or ((stop - start) % BLOCK and stop - start != size):
        raise CheckpointError(
            f"tensor parallel: cannot split {record.name}: each rank would hold {stop - start} of its {size} "
            f"{_DIMS[dim]} (this rank [{start}:{stop}]), not a multiple of {BLOCK}; {lay.scheme.origin} scales the "
            f"weight in {BLOCK}x{BLOCK} blocks, one scale per block, so a rank's part must be whole blocks (use a "
            f"tensor parallel size that gives every rank a multiple of {BLOCK}, or a per-tensor or per-channel "
            "checkpoint)"
        )
    blocks = slice(start // BLOCK, cdiv(stop, BLOCK))
    if dim == 0:
        return (blocks,)
    scale = record.parts[lay.scheme.scale_name]
    # ModelOpt's FP8_PB_WO scales are [N/128, 1, K/128, 1]: their block columns are dim 2.
    return (slice(None), slice(None), blocks) if len(scale.shape) == 4 else (slice(None), blocks)
