"""`fp8route serve` mistakes are one line and exit 2, before any model is loaded: a bad
--kv-cache-dtype, a port out of range or in use, a folder that is not there."""

import socket

import pytest
import serve_helpers  # noqa: F401 (the skip, or under CI the failure, without the serve extra)

from fp8route.cli import main


def test_a_port_in_use_is_one_line_at_once(tiny_folder, capsys, monkeypatch):
    from fp8route.serve import server

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the engine process started before the port was found taken")

    monkeypatch.setattr(server, "EngineProcess", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny_folder), "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fp8route serve: cannot listen on 127.0.0.1:{port}: Address already in use; give another --port, "
        "or --port 0 for a free one"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "--port must be 0-65535 (0 picks a free one), got 99999"),
        (["--port", "-1"], "--port must be 0-65535 (0 picks a free one), got -1"),
        (["--port", "0", "--kv-cache-dtype", "fp16"], "--kv-cache-dtype must be one of auto, fp8, got 'fp16'"),
        (["--port", "0", "--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:0: "),
    ],
)
def test_bad_flags_are_one_line(tiny_folder, capsys, argv, message):
    assert main(["serve", str(tiny_folder), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("fp8route serve: " + message), err


def test_a_folder_that_is_not_there_is_named_as_such(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fp8route serve: {tmp_path / 'nope'} is not there: expected a checkpoint folder holding config.json"
