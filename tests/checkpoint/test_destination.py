"""Where `quantize` writes: a destination it cannot use is one line before any work, a failure or a
SIGTERM while writing leaves nothing behind.

Root ignores permission bits, and CI runs as root: the read-only cases drop the capabilities that
let root write anywhere (setpriv) or make the folder immutable (chattr +i), so the kernel really
refuses the write, whoever runs the tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
from checkpoint_helpers import TINY, llama_tensors, write_checkpoint
from safetensors import SafetensorError

import fp8route
from fp8route import CheckpointError, Fp8InputError, quantize_checkpoint
from fp8route.checkpoint import destination, shards
from fp8route.checkpoint.calibration import generated_token_ids
from fp8route.checkpoint.destination import write_folder, write_into
from fp8route.checkpoint.random import write_random
from fp8route.cli import main

CALIB = generated_token_ids(TINY["vocab_size"], sequences=2, length=16, seed=1)
ROOT = Path(fp8route.__file__).parent.parent
# Without these two capabilities root is held to permission bits like any user.
UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bf16") / "src", llama_tensors(), TINY)


def one_line(err: str) -> str:
    err = err.strip()
    assert err.count("\n") == 0 and err.startswith("fp8route quantize: "), err
    return err


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "fp8route", "quantize", *argv]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def as_unprivileged() -> list[str]:
    """The prefix that runs a command held to permission bits: none for a user, setpriv for root."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a folder read-only to this process")
    probe = subprocess.run([*UNPRIVILEGED, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.strip()}")
    return UNPRIVILEGED


def test_a_read_only_folder_is_one_line_before_any_work(source, tmp_path):
    prefix = as_unprivileged()
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        argv = [str(source), str(folder / "fp8"), "--format", "modelopt", "--device", "cpu"]
        done = subprocess.run([*prefix, *command(*argv)], capture_output=True, text=True, env=environment())
    finally:
        folder.chmod(0o755)
    assert done.returncode == 2, done.stderr
    err = one_line(done.stderr)  # one line: the progress bar never started
    assert f"destination {folder / 'fp8'}: {folder} is not writable" in err and "choose a folder you can write" in err
    assert list(folder.iterdir()) == [] and done.stdout == ""


def test_an_immutable_folder_is_refused_by_the_api(source, tmp_path):
    folder = tmp_path / "immutable"
    folder.mkdir()
    made = (
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if shutil.which("chattr")
        else None
    )
    if made is None or made.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip() if made else 'no chattr'}")
    calls: list[int] = []
    try:
        for dst in (folder, folder / "fp8"):  # an empty dst the rename would replace, and a new one inside
            with pytest.raises(Fp8InputError, match=f"{folder} is not writable"):
                quantize_checkpoint(source, dst, calib=CALIB, device="cpu", progress=lambda *a: calls.append(1))
        listing = list(folder.iterdir())
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert listing == [] and calls == []


def test_not_enough_space_is_one_line_before_any_work(source, tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    dst = tmp_path / "out" / "fp8"
    assert main(["quantize", str(source), str(dst), "--format", "modelopt", "--device", "cpu"]) == 2
    err = one_line(capsys.readouterr().err)
    # bf16 embedding and lm_head (2 x 256 x 64 x 2 bytes) plus 14 FP8 linears.
    assert f"destination {dst}: the checkpoint needs about 0.2 MB and {tmp_path} has 0.0 MB free" in err
    assert "free some space or choose another disk" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gb", ["0", "-1", "inf", "nan"])
def test_max_shard_gb_must_be_positive(source, tmp_path, capsys, gb):
    argv = ["quantize", str(source), str(tmp_path / "q"), "--format", "modelopt", "--max-shard-gb", gb]
    assert main(argv) == 2
    assert f"--max-shard-gb must be a positive number of GiB, got {float(gb)}" in one_line(capsys.readouterr().err)
    with pytest.raises(Fp8InputError, match="max_shard_bytes must be a positive number of bytes, got 0"):
        quantize_checkpoint(source, tmp_path / "q", calib=CALIB, max_shard_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_destinations_the_rename_could_not_take(source, tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Fp8InputError, match="link is a symbolic link; give a new folder or the one it points to"):
        quantize_checkpoint(source, tmp_path / "link", calib=CALIB)
    (tmp_path / "mounted").mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == tmp_path / "mounted")
    with pytest.raises(Fp8InputError, match="mounted is a mount point; choose a new folder inside it"):
        quantize_checkpoint(source, tmp_path / "mounted", calib=CALIB)
    with pytest.raises(Fp8InputError, match="names no new folder"):
        quantize_checkpoint(source, tmp_path / "mounted" / "..", calib=CALIB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link", "mounted"]


def test_an_empty_folder_is_filled(source, tmp_path):
    (tmp_path / "empty").mkdir()
    report = quantize_checkpoint(source, tmp_path / "empty", calib=CALIB, device="cpu")
    assert (tmp_path / "empty" / "model.safetensors").is_file() and report.dst == tmp_path / "empty"
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def fail_writing_a_shard(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def fail_copying(src, dst, **kwargs):
    raise OSError(28, "No space left on device", str(dst))


@pytest.mark.parametrize(
    ("where", "fail", "message"),
    [
        (shards, ("save_file", fail_writing_a_shard), "/.part-00000.safetensors)"),
        (None, ("copy2", fail_copying), "/tokenizer_config.json)"),
    ],
)
def test_an_os_error_while_writing_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, where, fail, message):
    src = write_checkpoint(tmp_path / "src", llama_tensors(), TINY, **{"tokenizer_config.json": {}})
    import fp8route.checkpoint.quantize as quantize_module

    monkeypatch.setattr(where or quantize_module.shutil, *fail)
    dst = tmp_path / "out" / "fp8"
    assert main(["quantize", str(src), str(dst), "--format", "modelopt", "--device", "cpu", "--quiet"]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"fp8route quantize: cannot write {dst}: No space left on device (")
    assert message in err and err.endswith("; the partial output was removed")
    assert list((tmp_path / "out").iterdir()) == []


def test_sigterm_while_quantizing_leaves_nothing(tmp_path):
    # Big enough that calibration takes seconds on a CPU; the hidden folder appears before it starts.
    config = {**TINY, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "vocab_size": 4096}
    src = write_random(tmp_path / "src", config, fp8=False, device="cpu")
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(src), str(out / "fp8"), "--format", "modelopt", "--device", "cpu", "--quiet"]
    process = subprocess.Popen(
        command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment()
    )
    deadline = time.monotonic() + 300
    while not any(out.iterdir()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if process.poll() is not None or not any(out.iterdir()):
        process.kill()
        pytest.fail(f"quantize did not start writing (exit {process.returncode}): {process.communicate()[1][-3000:]}")
    assert [p.name.startswith(".fp8.partial-") for p in out.iterdir()] == [True]
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert (process.returncode, stdout) == (143, ""), stderr[-3000:]
    assert one_line(stderr) == "fp8route quantize: terminated (SIGTERM)"
    assert list(out.iterdir()) == []


def test_write_folder_and_write_into_clean_up_after_any_failure(tmp_path):
    def half_then(error: BaseException):
        def write(folder: Path) -> None:
            (folder / "model.safetensors").write_text("half")
            raise error

        return write

    with pytest.raises(CheckpointError, match=r"cannot write .*new: Disk quota exceeded \(/x\); the partial output"):
        write_folder(tmp_path / "new", half_then(OSError(122, "Disk quota exceeded", "/x")))
    with pytest.raises(KeyboardInterrupt):
        write_folder(tmp_path / "new", half_then(KeyboardInterrupt()))
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        write_into(tmp_path / "hf", half_then(KeyboardInterrupt()))
    with pytest.raises(CheckpointError, match="cannot write .*made: Disk quota exceeded"):
        write_into(tmp_path / "made", half_then(OSError(122, "Disk quota exceeded", "/x")))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and [p.name for p in (tmp_path / "hf").iterdir()] == [
        "tokenizer.json"
    ]
    assert write_into(tmp_path / "hf", lambda folder: (folder / "config.json").write_text("{}")) == 2
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "tokenizer.json"]


def test_an_interrupt_just_after_the_hidden_folder_is_made_still_removes_it(tmp_path, monkeypatch):
    make = Path.mkdir

    def mkdir_then_interrupt(self, *args, **kwargs):
        make(self, *args, **kwargs)
        if "partial-" in self.name:
            raise KeyboardInterrupt  # as a signal handler would, at the next bytecode

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    for write in (write_folder, write_into):
        with pytest.raises(KeyboardInterrupt):
            write(tmp_path / "out", lambda folder: None)
    assert list(tmp_path.iterdir()) == []
