"""Every engine setting on every command comes from EngineConfig: no command declares a flag for one of
its fields by hand, and the flags the generator makes parse as the commands read them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fp8route.cli
from fp8route.cli import build_parser
from fp8route.engine.config import FIELDS

CLI = Path(fp8route.cli.__file__).parent
# bench serve --url's `--model NAME` is the name the HTTP client asks the server for (dest served_model),
# the OpenAI request's field: not the engine's model.
NOT_ENGINE = {("bench_serve_http.py", "--model")}


def hand_written_engine_flags(source: str) -> list[str]:
    """The add_argument calls in this source whose flag or dest names an EngineConfig field."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        names += [k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)]
        found += [n for n in names if n.lstrip("-").replace("-", "_") in FIELDS]
    return found


def test_no_command_declares_an_engine_flag_by_hand():
    found = {
        path.name: names
        for path in sorted(CLI.glob("*.py"))
        if (names := [n for n in hand_written_engine_flags(path.read_text()) if (path.name, n) not in NOT_ENGINE])
    }
    assert not found, f"flags for EngineConfig fields not made by add_engine_args: {found}"


def test_the_check_finds_a_hand_written_flag():
    source = 'p.add_argument("--kv-cache-dtype", default="auto")\np.add_argument("--x", dest="max_num_seqs")'
    assert hand_written_engine_flags(source) == ["--kv-cache-dtype", "max_num_seqs"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "serve", "m"], {"enable_prefix_caching": "on", "async_scheduling": "on", "kv_cache_dtype": "auto"}),
        (["bench", "serve", "m", "--prefix-caching", "on,off"], {"enable_prefix_caching": "on,off"}),
        (
            ["bench", "e2e", "--random", "x"],
            {"pdl": "auto", "quantize_upstream": "on", "tp": "1", "attention": "builtin"},
        ),
        (["bench", "e2e", "--tp", "1,2", "--all-reduce", "nccl,fused"], {"tp": "1,2", "all_reduce": "nccl,fused"}),
        (["eval", "m", "--task", "arc_easy"], {"kv_cache_dtype": "auto", "dtype": "auto", "device": None}),
        (["bench", "idle", "p"], {"max_model_len": 8192}),
        (["tune", "--model", "x.json"], {"model": "x.json", "tp": "1", "dtype": "bfloat16", "device": "cuda"}),
        (["demo"], {"device": None, "dtype": "bfloat16"}),
        (["quantize", "a", "b"], {"device": None}),
        (["generate", "m", "--prompt", "x", "--no-use-cuda-graphs"], {"use_cuda_graphs": False, "tp": 1}),
    ],
)
def test_the_generated_flags_keep_each_commands_spelling_and_default(argv, expected):
    args = build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected
