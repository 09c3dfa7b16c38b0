"""Safetensors shards of a Hugging Face-style folder: listed, validated from headers, read one at a time.

Only safetensors are ever opened: a pickle (pytorch_model.bin, *.pt) can run code when loaded.
Headers are cheap to read, so every shard's header is checked before any tensor data is.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fp8route.checkpoint.hub import repository_of
from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.quant import dtype_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

Index = tuple[slice, ...]  # the part of a tensor to read: (rows,) or (slice(None), columns)


class Slices(Protocol):
    """Tensor name -> the index to read (None or absent: the whole tensor); a dict will do."""

    def get(self, name: str, /) -> Index | None: ...


DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # the shard's name inside the folder
    dtype: str  # as safetensors spells it: "F8_E4M3", "BF16", ...
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype)

    @property
    def dtype_name(self) -> str:
        dtype = self.torch_dtype
        return dtype_name(dtype) if dtype is not None else self.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def where(self) -> str:
        return f"{self.name} in {self.file}"


@dataclass(frozen=True)
class ShardSet:
    folder: Path
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> ShardSet:
        """Every tensor's shard, dtype and shape, from the index (if any) and the shard headers."""
        root = Path(folder)
        if not root.is_dir():
            raise CheckpointError(
                f"{root}: not a folder (expected a checkpoint folder with config.json and *.safetensors)"
            )
        index = root / INDEX
        weight_map = _read_index(index) if index.is_file() else None
        files = (
            sorted(set(weight_map.values()))
            if weight_map is not None
            else sorted(p.name for p in root.glob("*.safetensors"))
        )
        if not files:
            pickles = sorted(p.name for pattern in _PICKLES for p in root.glob(pattern))
            hint = (
                f" ({', '.join(pickles)} are pickles, which fp8route never loads: convert them to safetensors)"
                if pickles
                else ""
            )
            raise CheckpointError(f"{root}: no *.safetensors files{hint}")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            path = _inside(root, file, INDEX if weight_map is not None else "the folder")
            for info in _header(path, file):
                if info.name in tensors:
                    raise CheckpointError(f"tensor {info.name} is in two shards: {tensors[info.name].file} and {file}")
                if weight_map is not None and weight_map.get(info.name) != file:
                    listed = weight_map.get(info.name)
                    said = f"names {listed}" if listed else "does not list it"
                    raise CheckpointError(f"tensor {info.name} is in {file} but {INDEX} {said}")
                tensors[info.name] = info
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise CheckpointError(
                    f"{INDEX} lists {len(missing)} tensor(s) absent from their shards, "
                    f"e.g. {missing[0]} in {weight_map[missing[0]]}"
                )
        return cls(root, tuple(files), tensors)

    def by_file(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {file: [] for file in self.files}
        for info in self.tensors.values():
            out[info.file].append(info.name)
        return out

    def read(
        self, file: str, names: list[str] | None = None, slices: Slices | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one shard (all, or those named), through safetensors' mmap; a tensor that
        slices has an index for is read as that part only, never whole."""
        path = self.folder / file
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names if names is not None else list(f.keys()):
                    index = slices.get(name) if slices is not None else None
                    if index is None:
                        yield name, f.get_tensor(name)
                    else:
                        self._check_index(name, index)
                        yield name, f.get_slice(name)[index].contiguous()
        except SafetensorError as e:
            raise CheckpointError(f"{file} in {self.folder}: cannot read safetensors data: {e}") from None

    def _check_index(self, name: str, index: Index) -> None:
        info = self.tensors[name]
        for dim, piece in enumerate(index):
            size = info.shape[dim] if dim < len(info.shape) else 0
            start, stop = piece.start or 0, size if piece.stop is None else piece.stop
            if piece.step not in (None, 1) or not 0 <= start < stop <= size:
                raise CheckpointError(
                    f"{info.where} has shape {list(info.shape)}: no [{start}:{stop}] on dim {dim} for this rank "
                    "to read (does config.json match the tensors?)"
                )

    def read_one(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name} not found in the shards of {self.folder}")
        return next(self.read(info.file, [name]))[1]


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{INDEX} in {path.parent} is not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f'{INDEX} in {path.parent}: expected a "weight_map" object of tensor name -> shard file')
    return weight_map


def _inside(root: Path, file: str, named_by: str) -> Path:
    """The shard's path, refusing names that reach outside the checkpoint folder."""
    candidate = Path(file)
    if candidate.is_absolute() or ".." in candidate.parts or len(candidate.parts) != 1:
        raise CheckpointError(
            f"{named_by} names shard {file!r}, outside the checkpoint folder {root}; only plain file names are allowed"
        )
    path = root / candidate
    target = path.resolve()
    if not target.is_relative_to(root.resolve()):
        # A hub-cache snapshot's files are links into its own repository's blobs/, and only there.
        repository = repository_of(root)
        if repository is None:
            raise CheckpointError(f"shard {file} in {root} links to {target}, outside the checkpoint folder")
        if not target.is_relative_to(repository / "blobs"):
            raise CheckpointError(
                f"shard {file} in {root} links to {target}, outside the checkpoint folder and outside "
                f"{repository / 'blobs'}, where its hub-cache repository keeps its files"
            )
    if not path.is_file():
        raise CheckpointError(f"{named_by} names shard {file}, which is not in {root}")
    if not file.endswith(".safetensors"):
        raise CheckpointError(f"{named_by} names shard {file}: fp8route reads *.safetensors only, never pickles")
    return path


def _header(path: Path, file: str) -> list[TensorInfo]:
    try:
        with safe_open(str(path), framework="pt") as f:
            infos = []
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                piece = f.get_slice(name)
                infos.append(TensorInfo(name, file, piece.get_dtype(), tuple(piece.get_shape())))
            return infos
    except SafetensorError as e:
        raise CheckpointError(
            f"{file} in {path.parent} is not a valid safetensors file (truncated or corrupt?): {e}"
        ) from None


def check_shard_bytes(max_bytes: object) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise Fp8InputError(f"max_shard_bytes must be a positive number of bytes, got {max_bytes!r}")


class ShardWriter:
    """Writes tensors into shards of at most max_bytes each, then the index if there is more than one."""

    def __init__(self, folder: Path, max_bytes: int = 5 * 2**30) -> None:
        check_shard_bytes(max_bytes)
        self.folder, self.max_bytes = folder, max_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.folder / f".part-{len(self._written):05d}.safetensors"
        try:
            save_file(self._pending, str(path), metadata={"format": "pt"})
        except SafetensorError as e:
            # safetensors reports a full disk or a refused write as its own error, with the OS's
            # errno in the text: made an OSError again, so callers handle every failed write alike.
            found = re.search(r"os error (\d+)", str(e))
            code = int(found.group(1)) if found else errno.EIO
            raise OSError(code, os.strerror(code) if found else str(e), str(path)) from None
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Name the shards as Hugging Face does and write the index; returns the shard names."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map: dict[str, str] = {}
        for (path, tensors), name in zip(self._written, names, strict=True):
            path.rename(self.folder / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names
