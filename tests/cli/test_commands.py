"""The command as a newcomer meets it: generate on a tiny checkpoint, and mistakes as one line, exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, synthetic_gguf_metadata, write_checkpoint

import fp8route
from fp8route import LLM, SamplingParams, quantize_checkpoint
from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
from fp8route.checkpoint.random import write_random
from fp8route.cli import main
from fp8route.engine import load_model


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer, quantized to ModelOpt FP8."""
    metadata = synthetic_gguf_metadata()
    config = dict(TINY, vocab_size=len(metadata["tokenizer.ggml.tokens"]), eos_token_id=2)
    root = tmp_path_factory.mktemp("cli")
    bf16 = write_checkpoint(root / "bf16", llama_tensors(config), config)
    write_tokenizer(metadata, bf16)
    return quantize_checkpoint(bf16, root / "fp8", format="modelopt", device="cpu").dst


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"fp8route {command}: "), err
    return err


def test_generate_streams_and_times_a_checkpoint(tiny_fp8, capsys):
    assert main(["generate", str(tiny_fp8), "--prompt", "the theme", "--max-tokens", "5", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "plan: " in err and "FP8 linears on cpu" in err and "TTFT" in err and "prompt tokens" in err
    assert "decode (M=1): cpu_dequant x8; made at plan time: " in err


def test_generate_with_an_fp8_kv_cache_keeps_it_in_e4m3_and_streams_the_models_answer(tiny_fp8, capsys, monkeypatch):
    from fp8route.cli import generate

    loaded = []
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)) or loaded[-1])
    argv = ["generate", str(tiny_fp8), "--prompt", "the theme", "--max-tokens", "5", "--device", "cpu"]
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 0
    printed = capsys.readouterr()
    (model,) = loaded
    assert model.config.kv_cache_dtype == "fp8" and model.engine.runner.pool.dtype == torch.float8_e4m3fn
    assert "(cpu, bfloat16, KV cache float8_e4m3fn)" in printed.err
    llm = LLM(tiny_fp8, device="cpu", kv_cache_dtype="fp8", max_num_seqs=1)
    (expected,) = llm.generate("the theme", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert expected.text and printed.out == expected.text + "\n"


def test_generate_tp2_starts_two_ranks_and_says_the_same(tiny_fp8):
    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = ["generate", str(tiny_fp8), "--prompt", "the theme", "--max-tokens", "6", "--device", "cpu"]
        command = [sys.executable, "-m", "fp8route", *argv, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)

    one, two = generate(), generate("--tp", "2")
    assert two.stdout == one.stdout  # rank 0 alone prints, the same greedy text
    assert "tensor parallel rank 0 of 2; all-reduce gloo" in two.stderr and "tensor parallel" not in one.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "{tmp}/nowhere", "--prompt", "x"], "nowhere is not there: expected a checkpoint folder"),
        (["generate", "{fp8}", "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (
            ["generate", "{fp8}", "--prompt", "x", "--max-new-tokens", "0"],
            "--max-tokens must be at least 1",
        ),  # the old name
        # Checked before the model loads: a folder that is not there is not what it says.
        (
            ["generate", "{tmp}/nowhere", "--prompt", "x", "--temperature", "-1"],
            "generate: --temperature must be a number in [0, 2], got -1.0",
        ),
        (
            ["generate", "{fp8}", "--prompt", "x", "--device", "cuda"]
            if not torch.cuda.is_available()
            else ["generate", "{fp8}", "--prompt", "x", "--device", "tpu"],
            "device",
        ),  # fmt: skip
        (
            ["generate", "{fp8}", "--prompt", "x", "--device", "cpu", "--attention", "flashinfer"],
            "attention='flashinfer'",
        ),  # fmt: skip
        (
            ["generate", "{tmp}/nowhere", "--prompt", "x", "--kv-cache-dtype", "int8"],
            "--kv-cache-dtype must be one of auto, fp8, got 'int8'",
        ),
        (
            ["eval", "{fp8}", "--task", "hellaswag", "--device", "cpu", "--kv-cache-dtype", "fp4"],
            "auto, fp8, got 'fp4'",
        ),
        (["bench", "serve", "{fp8}", "--kv-cache-dtype", "auto,e5m2"], "--kv-cache-dtype must be one of auto, fp8"),
        (["bench", "serve", "{fp8}", "--prefill-graphs", "yes"], "--prefill-graphs: on, off or on,off, got 'yes'"),
        (["serve", "{fp8}", "--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
        (
            ["generate", "{fp8}", "--prompt", "x", "--temperature", "nan"],
            "generate: --temperature must be a number in [0, 2], got NaN (not a number)",
        ),
        (
            ["generate", "{fp8}", "--prompt", "x", "--temperature", "2.5"],
            "--temperature must be a number in [0, 2], got 2.5",
        ),
        (["bench", "serve", "{fp8}", "--async-scheduling", "1"], "--async-scheduling: on, off or on,off, got '1'"),
        (["demo", "--layers", "0"], "--layers must be at least 1"),
        (["inspect", "{fp8}/config.json"], "expected a checkpoint folder"),
        (["inspect", "{tmp}"], "config.json not found in"),  # an empty folder: its config is what it lacks first
        (["eval", "{tmp}", "--task", "hellaswag", "--device", "cpu"], "config.json not found in"),
        (["generate", "{tmp}", "--prompt", "x", "--device", "cpu"], "config.json not found in"),
        (["bench", "e2e", "--random", "llama-3.1-8b"], "CUDA GPU"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(tiny_fp8, tmp_path, capsys, argv, message):
    if argv[0] == "bench" and torch.cuda.is_available():
        pytest.skip("a GPU is here: bench would run")
    argv = [a.format(tmp=tmp_path, fp8=tiny_fp8) for a in argv]
    assert main(argv) == 2
    assert message in one_line_error(capsys, argv[0])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "tensor parallel size 3 does not divide 4 attention heads, intermediate size 160"),
        (
            ["--max-tokens", "9000"],
            "a prompt of 1 tokens + --max-tokens 9000 = 9001 exceeds the model's context of 8192 tokens; "
            "shorten the prompt or lower --max-tokens",
        ),
    ],
)
def test_generate_refuses_before_it_loads_or_starts_ranks(tiny_fp8, capsys, monkeypatch, extra, message):
    from fp8route.cli import generate

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("generate went on to load the model or start ranks")

    monkeypatch.setattr(generate, "run_ranks", never)
    monkeypatch.setattr(generate, "load_model", never)
    assert main(["generate", str(tiny_fp8), "--prompt", "x", "--device", "cpu", *extra]) == 2
    assert one_line_error(capsys, "generate").startswith(f"fp8route generate: {message}")


def test_an_unknown_forced_backend_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("FP8ROUTE_FORCE", "nope")
    assert main(["demo", "--device", "cpu", "--layers", "1", "--tokens", "2"]) == 2
    assert "unknown backend 'nope'" in one_line_error(capsys, "demo")


def test_python_dash_m_and_version():
    done = subprocess.run([sys.executable, "-m", "fp8route", "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"fp8route {fp8route.__version__}"


def test_explain_takes_a_checkpoint(tiny_fp8):
    text = fp8route.explain(fp8route.load_checkpoint(tiny_fp8, device="cpu"))
    assert "model.layers.0.self_attn.qkv_proj" in text and "M 1+ -> cpu_dequant" in text
    assert text.splitlines()[-1].startswith("made at plan time, all 8 layers: ")


def test_a_random_checkpoint_of_real_form_loads_and_generates(tmp_path):
    config = {**TINY, "vocab_size": 64, "architectures": ["LlamaForCausalLM"]}
    folder = write_random(tmp_path / "random", config, fp8=True, device="cpu")
    model = load_model(folder, device="cpu", max_num_seqs=2, max_model_len=16)
    assert len(model.module.model.layers) == TINY["num_hidden_layers"]
    out = model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), 4)
    assert out.shape == (2, 7) and bool((out[:, :3] == torch.tensor([[1, 2, 3], [4, 5, 6]])).all())


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "smollm2", "--device", "cpu"],
        ["eval", "smollm2", "--text", "{tmp}/text.txt", "--text-seq-len", "8", "--limit", "1", "--out", "{tmp}"],
        ["generate", "smollm2", "--prompt", "the theme", "--max-tokens", "2", "--device", "cpu"],
    ],
)
def test_every_command_taking_a_model_knows_the_smollm2_name(tiny_fp8, tmp_path, monkeypatch, capsys, argv):
    import fp8route.checkpoint.smollm2 as smollm2

    monkeypatch.setattr(smollm2, "smollm2_folder", lambda fp8=True, progress=None, scheme="tensor": tiny_fp8)
    (tmp_path / "text.txt").write_text("the theme of the day is the theme of the night, said the other one\n" * 4)
    assert main([a.format(tmp=tmp_path) for a in argv]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "name, made",
    [
        ("smollm2", (True, "tensor")),
        ("smollm2-channel", (True, "channel")),
        ("smollm2-block", (True, "block")),
        ("smollm2-bf16", (False, "tensor")),
    ],
)
def test_each_smollm2_name_is_its_schemes_folder(tiny_fp8, monkeypatch, name, made):
    import fp8route.checkpoint.smollm2 as smollm2
    from fp8route.engine.load import resolve_model

    asked: list[tuple[bool, str]] = []

    def folder(fp8=True, progress=None, scheme="tensor"):
        asked.append((fp8, scheme))
        return tiny_fp8

    monkeypatch.setattr(smollm2, "smollm2_folder", folder)
    assert resolve_model(name) == tiny_fp8 and asked == [made]


def test_a_folder_whose_name_starts_like_smollm2_is_a_folder(tiny_fp8, tmp_path, monkeypatch):
    import shutil

    from fp8route.engine.load import resolve_model

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_fp8, tmp_path / "smollm2-mine")
    assert resolve_model("smollm2-mine").resolve() == tmp_path / "smollm2-mine"


def test_eval_on_a_cpu_computes_with_the_engines_thread_count(tiny_fp8, tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    (tmp_path / "text.txt").write_text("the theme of the day is the theme of the night\n" * 4)
    argv = ["eval", str(tiny_fp8), "--text", str(tmp_path / "text.txt"), "--text-seq-len", "8", "--limit", "1"]
    assert main([*argv, "--device", "cpu", "--out", str(tmp_path), "--quiet"]) == 0
    assert asked == [2]  # three cores, one left to the host


def test_no_log_message_begins_with_the_loggers_name():
    """The command line's LOG_FORMAT prints the logger's name ("fp8route: ") before every message."""
    package = Path(fp8route.__file__).parent
    call = re.compile(r"log\.(?:debug|info|warning|error|exception)\(\s*f?[\"']fp8route")
    found = [f"{p.relative_to(package)}" for p in package.rglob("*.py") if call.search(p.read_text())]
    assert found == []


def test_sigterm_is_exit_143_even_where_an_extension_turned_it_into_its_own_error(monkeypatch, tmp_path, capsys):
    """The signal's exception can land inside an extension's call back into Python, which raises an error of its
    own instead (safetensors' get_tensor raised a ValueError): still SIGTERM, exit 143, one line."""
    import os
    import signal

    from fp8route.cli import inspect

    def run(args):  # type: ignore[no-untyped-def]
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode, inside this try
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
        return 0

    monkeypatch.setattr(inspect, "run", run)
    assert main(["inspect", str(tmp_path)]) == 143
    assert one_line_error(capsys, "inspect") == "fp8route inspect: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.undo()
    assert main(["inspect", str(tmp_path / "absent")]) == 2  # the next call's error is not taken for a SIGTERM
