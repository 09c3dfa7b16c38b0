"""Where a checkpoint folder is written: checked before any work, then written into a hidden folder
beside it and renamed into place, so a failure (an OSError, Ctrl-C, SIGTERM) leaves nothing behind.

Root ignores permission bits, so the checks ask the kernel (os.access), which also answers for
read-only file systems and immutable folders, rather than reading the mode.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from fp8route.errors import CheckpointError, Fp8InputError

T = TypeVar("T")


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once, at import: umask has no getter


def check_destination(dst: Path, src: Path | None = None, needed_bytes: int = 0) -> None:
    """Raise Fp8InputError unless dst can become a new checkpoint folder holding about needed_bytes:
    dst is new or an empty folder (not the source, a file, a link or a mount point) and the folder
    it goes into can be written and has the space."""
    if dst.name in ("", ".", ".."):
        raise Fp8InputError(f"destination {dst} names no new folder; give one, e.g. {dst / 'fp8'}")
    if src is not None and dst.resolve() == src.resolve():
        raise Fp8InputError(f"destination {dst} is the source folder; choose a new folder")
    if dst.is_symlink():
        raise Fp8InputError(f"destination {dst} is a symbolic link; give a new folder or the one it points to")
    if dst.exists() and not dst.is_dir():
        raise Fp8InputError(f"destination {dst} is a file; choose a new folder")
    if dst.exists() and any(dst.iterdir()):
        raise Fp8InputError(f"destination {dst} exists and is not empty; choose a new or empty folder")
    if dst.exists() and os.path.ismount(dst):
        # The finished folder is renamed onto dst, which a mount point refuses (EBUSY).
        raise Fp8InputError(f"destination {dst} is a mount point; choose a new folder inside it")
    if dst.exists():
        check_writable(dst, f"destination {dst}")
    check_room(dst.parent, needed_bytes, f"destination {dst}")


def check_room(folder: Path, needed_bytes: int, what: str) -> None:
    """Raise Fp8InputError unless folder (or the nearest parent that exists, when it does not)
    can be written and has needed_bytes free."""
    base = existing_ancestor(folder)
    if not base.is_dir():
        raise Fp8InputError(f"{what}: {base} is a file, not a folder; choose another path")
    check_writable(base, what)
    free = shutil.disk_usage(base).free
    if needed_bytes > free:
        raise Fp8InputError(
            f"{what}: the checkpoint needs about {_size(needed_bytes)} and {base} has {_size(free)} free; "
            "free some space or choose another disk"
        )


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def existing_ancestor(path: Path) -> Path:
    """path, or its nearest parent that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(folder: Path, what: str) -> None:
    """Raise Fp8InputError unless new entries can be made in folder (and it can be entered)."""
    if os.access(folder, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only file system" if read_only else "is not writable (permissions, or an immutable folder)"
    raise Fp8InputError(f"{what}: {folder} {why}; choose a folder you can write to")


def write_folder(dst: Path, write: Callable[[Path], T], *, replace: bool = False) -> T:
    """write(tmp) into a hidden folder beside dst, then renamed to dst; returns what write returned.

    Any failure, an interrupt included, removes the hidden folder: nothing is left behind. An
    OSError becomes one CheckpointError naming the path and the reason. dst must be absent or an
    empty folder (the rename replaces it) unless replace, which removes an existing dst first."""
    with _one_line_os_errors(dst):
        staging = _hidden(dst.parent, f".{dst.name}.partial-")
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            result = write(staging)
            _readable(staging)
            if replace and dst.exists():
                shutil.rmtree(dst)
            staging.rename(dst)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return result


def write_into(folder: Path, write: Callable[[Path], T]) -> T:
    """write(tmp) into a hidden folder inside folder, whose files then replace folder's files of
    the same names (what else folder holds stays); returns what write returned.

    Any failure, an interrupt included, removes the hidden folder, and folder too when this call
    made it; an OSError becomes one CheckpointError naming the path and the reason."""
    made = not folder.exists()
    with _one_line_os_errors(folder):
        staging = _hidden(folder, ".fp8route-partial-")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            try:
                result = write(staging)
                _readable(staging)
                for path in sorted(staging.iterdir()):
                    path.replace(folder / path.name)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            if made:
                shutil.rmtree(folder, ignore_errors=True)
            raise
    return result


def _readable(folder: Path) -> None:
    """Files get the mode the umask gives a new file: safetensors writes its files 0600, so a
    checkpoint copied to another user could not be read."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~_UMASK)


def _hidden(parent: Path, prefix: str) -> Path:
    # Named before it is made (mkdtemp names and makes it at once): an interrupt that lands just
    # after the mkdir still finds the name, inside the try that removes it.
    return parent / f"{prefix}{secrets.token_hex(8)}"


@contextmanager
def _one_line_os_errors(dst: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"cannot write {dst}: {os_reason(e)}; the partial output was removed") from None


def os_reason(e: OSError) -> str:
    """What the OS said and about which path: "Permission denied (/x/y)"."""
    reason = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{reason} ({' -> '.join(paths)})" if paths else reason
