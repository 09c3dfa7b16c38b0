"""`fp8route bench serve --url` against the real server: the offline benchmark's report, every request
accounted for (completed, or closed on purpose by --disconnect-fraction), and the pool empty after."""

import json
import socket

from serve_helpers import API_KEY, MODEL, metrics

from fp8route.cli import main


def test_bench_serve_url_accounts_for_every_request_and_finds_the_pool_empty(server, tiny_folder, tmp_path, capsys):
    before = metrics(server.url)
    # Outputs up to 64 tokens: a client that leaves early leaves the server tokens to make, so some aborts
    # reach it (at 6:16 the tiny model often finished every request first: 0 aborts in 1 of 3 runs here).
    argv = ["bench", "serve", str(tiny_folder), "--url", server.url, "--api-key", API_KEY, "--num-prompts", "30",
            "--input-len", "8:40", "--output-len", "6:64", "--disconnect-fraction", "0.5", "--seed", "3",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / f"serve-http-{MODEL}.json").read_text())
    report = doc["reports"][0]
    outcomes = report["extra"]["outcomes"]
    assert set(outcomes) == {"completed", "disconnected"} and sum(outcomes.values()) == 30, outcomes
    assert outcomes["disconnected"] >= 5
    assert report["completed"] == outcomes["completed"] and report["failed"] == 0
    assert report["extra"]["model"] == MODEL and report["extra"]["kv_cache_used_blocks_after"] == 0
    assert report["ttft_ms"]["p50"] > 0 and report["itl_ms"]["p50"] > 0 and report["output_throughput"] > 0
    assert f"30 requests: {outcomes['completed']} completed, {outcomes['disconnected']} disconnected" in printed
    assert "KV pool empty after the run" in printed and "server memory:" in printed
    after = metrics(server.url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    aborted, finished = (
        delta["fp8route:request_aborted_total"],
        delta['fp8route:request_success_total{finished_reason="length"}'],
    )
    # a client may close just after the server sent its last token: that one finished there, not aborted
    assert aborted + finished == 30 + 8 and aborted >= 1, delta  # the load and its 8 warm-up requests


def test_bench_serve_url_without_the_model_folder_says_what_to_give(server, capsys):
    assert main(["bench", "serve", "--url", server.url, "--api-key", API_KEY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fp8route bench: --url: also give the served checkpoint's folder as MODEL (or --random NAME for a random one): "
        "the load's token ids must fit its vocabulary"
    ]


def test_bench_serve_url_with_nobody_listening_is_one_line(tiny_folder, capsys):
    with socket.socket() as probe:  # a port that was free a moment ago, and now nobody's
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    for model in ([], ["--model", MODEL]):
        assert main(["bench", "serve", str(tiny_folder), "--url", url, "--num-prompts", "2", *model]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"fp8route bench: --url {url}: Cannot connect to host"), err
        assert err.endswith("is the server running there?"), err
