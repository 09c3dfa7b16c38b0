"""Where routing tables live, how they are written (atomically) and which one a device gets.

Lookup order for a device: an explicit path, else $FP8ROUTE_TABLE, else the user cache
($XDG_CACHE_HOME/fp8route or ~/.cache/fp8route); a table there must carry this process's exact
fingerprint. Failing that, the tables shipped in fp8route/routing/defaults/ whose GPU matches.
Failing that, None: plans use the default priority. A bad file is a warning, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from fp8route.routing.fingerprint import DEVICE_FIELDS, Fingerprint
from fp8route.routing.table import RoutingTable, RoutingTableError

try:
    import fcntl
except ImportError:  # Windows: writes stay atomic, concurrent merges may drop one writer's shapes
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("fp8route")

ENV_TABLE = "FP8ROUTE_TABLE"
DEFAULTS_DIR = Path(__file__).parent / "defaults"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "fp8route"


def default_path(fingerprint: Fingerprint) -> Path:
    """$FP8ROUTE_TABLE, else the user cache file for this GPU."""
    env = os.environ.get(ENV_TABLE, "").strip()
    return Path(env).expanduser() if env else cache_dir() / f"routing-{fingerprint.slug}.json"


def display_path(path: Path) -> str:
    try:
        return "~/" + str(path.resolve().relative_to(Path.home().resolve()))
    except (ValueError, RuntimeError):
        return str(path)


def read_table(path: Path | str, origin: str | None = None) -> RoutingTable:
    """Parse one file; OSError or RoutingTableError (never a JSON error) on failure."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    where = origin or f"routing table {display_path(path)}"
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise RoutingTableError(f"{where}: not valid JSON ({exc})") from None
    return RoutingTable.from_json(obj, origin=where)


def save_table(table: RoutingTable, path: Path | str, *, merge: bool = True) -> RoutingTable:
    """Write atomically (readers see the old file or the new one, never a torn one) and return
    what was written: with merge, the shapes of a table with the same fingerprint already at
    path are kept unless this one retuned them."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if merge and path.exists():
            try:
                old = read_table(path)
            except (OSError, RoutingTableError) as exc:
                log.warning("replacing unreadable %s", exc)
            else:
                diff = old.fingerprint.differences(table.fingerprint)
                if diff:
                    log.warning("replacing %s: it was measured elsewhere (%s)", old.origin, "; ".join(diff))
                else:
                    table = old.merged_with(table)
        _write_atomic(path, json.dumps(table.to_json(), indent=1) + "\n")
    return table.with_origin(f"routing table {display_path(path)}")


def _write_atomic(path: Path, text: str) -> None:
    # The temporary file sits in the same directory so os.replace is a rename within one
    # filesystem, which POSIX makes atomic.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise read-merge-write cycles of concurrent tuners, so neither loses the other's shapes."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def load_table(
    device: torch.device | str | int | None = None,
    path: Path | str | None = None,
    *,
    fingerprint: Fingerprint | None = None,
    defaults_dir: Path | None = None,
) -> RoutingTable | None:
    """The table a CUDA device should route by, or None (default priority). Never raises on a
    bad or foreign file: it logs a warning saying why it was ignored and what to do."""
    fp = fingerprint or Fingerprint.of(device)
    if not fp.capability:
        return None
    explicit = path is not None or bool(os.environ.get(ENV_TABLE, "").strip())
    chosen = Path(path).expanduser() if path is not None else default_path(fp)
    table = _read_user_table(chosen, fp, explicit)
    if table is not None:
        return table
    shipped = shipped_table(fp, defaults_dir or DEFAULTS_DIR)
    if shipped is None:
        log.info("no routing table for %s: layers use the default priority (run `fp8route tune` to measure)", fp.gpu)
    return shipped


def _read_user_table(path: Path, fp: Fingerprint, explicit: bool) -> RoutingTable | None:
    if not path.exists():
        if explicit:
            log.warning("no routing table at %s; using defaults", path)
        return None
    try:
        table = read_table(path)
    except (OSError, RoutingTableError) as exc:
        log.warning("ignoring %s; using defaults. Delete the file or re-run `fp8route tune`.", exc)
        return None
    diff = table.fingerprint.differences(fp)
    if diff:
        log.warning(
            "ignoring %s: it was measured on another device or library version (table vs here: %s); "
            "using defaults. Re-run `fp8route tune` on this machine.",
            table.origin,
            "; ".join(diff),
        )
        return None
    return table


def shipped_table(fp: Fingerprint, defaults_dir: Path = DEFAULTS_DIR) -> RoutingTable | None:
    """The shipped table for this GPU. Only the device must match: measured with other library
    versions it is still a better guess than the fixed default priority, and explain() says so."""
    if not defaults_dir.is_dir():
        return None
    for file in sorted(defaults_dir.glob("*.json")):
        try:
            table = read_table(file, origin=f"shipped defaults {file.name}")
        except (OSError, RoutingTableError) as exc:
            log.warning("ignoring %s", exc)
            continue
        if table.fingerprint.differences(fp, only=DEVICE_FIELDS):
            continue
        drift = table.fingerprint.differences(fp)
        if drift:
            log.info(
                "%s were measured with other versions (%s); `fp8route tune` measures this setup",
                table.origin,
                "; ".join(drift),
            )
            return table.with_origin(f"{table.origin}, measured with {_versions(table.fingerprint)}")
        return table
    return None


def _versions(fp: Fingerprint) -> str:
    return f"torch {fp.torch}, cuBLAS {fp.cublas}"
