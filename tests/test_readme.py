"""README's first Python snippet (the layer API) runs as written, on this machine's device."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_usage_snippet_runs_as_written(capsys):
    text = README.read_text()
    use = text[text.index("## Use") :]
    snippet = re.search(r"```python\n(.*?)```", use, re.S)
    assert snippet is not None, "README's Use section has no python block"
    exec(compile(snippet.group(1), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "routes (" in printed and "(+1 more with the same plan)" not in printed
