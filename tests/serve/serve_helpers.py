"""What the server tests share: the skip (or, under CI, the failure) without the serve extra and the
openai client, a real `fp8route serve` in a subprocess, and raw HTTP for what no client would send."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

NEEDED = ("fastapi", "uvicorn", "prometheus_client", "aiohttp", "openai")
if os.environ.get("CI"):
    # CI installs the serve extra and openai (README's test command): a missing one fails here.
    for _name in NEEDED:
        __import__(_name)
else:
    for _name in NEEDED:
        pytest.importorskip(_name, reason=f"{_name} is missing: pip install -e '.[serve,dev]'; under CI this fails")

ROOT = Path(__file__).resolve().parents[2]  # the repository: its fp8route is the one the server runs
API_KEY = "test-key"
MODEL = "tiny"
READY = re.compile(r"fp8route serve: .* at (http://[\d.]+:\d+)/v1")


class Server:
    """`python -m fp8route serve FOLDER --port 0 --device cpu ARGS` until stop(); its output in a file."""

    def __init__(self, folder: Path, log: Path, *args: str, timeout: float = 180.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.log_path = log
        command = [sys.executable, "-m", "fp8route", "serve", str(folder), "--port", "0", "--device", "cpu", *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.url = self._wait_ready(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the server exited with {self.proc.returncode} before it was ready:\n{self.log()}"
                )
            found = READY.search(self.log())
            if found:
                status, body = request(found.group(1) + "/health")
                assert status == 200 and body == {"status": "ok"}, (status, body)
                return found.group(1)
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the server was not ready within {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server did not exit within {timeout} s of {sig!r}:\n{self.log()}") from None
        return self.proc.returncode


def request(
    url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None, method: str | None = None
) -> tuple[int, dict | str]:
    """(status, the JSON body or the text) of one HTTP request, errors included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            status, raw, kind = response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as error:
        status, raw, kind = error.code, error.read(), error.headers.get("content-type", "")
    return status, json.loads(raw) if "json" in kind else raw.decode()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    status, text = request(url + "/metrics")
    assert status == 200
    values = {}
    for line in str(text).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_for(check, timeout: float = 60.0, every: float = 0.05):  # type: ignore[no-untyped-def]
    """check()'s first truthy value within timeout, else its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)
