"""transformers is an optional extra: only fp8route/hf imports it, and fp8route works without it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fp8route

PACKAGE = Path(fp8route.__file__).parent


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_fp8route_hf_imports_transformers():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "hf" not in path.relative_to(PACKAGE).parts[:1] and "transformers" in imported_roots(path)
    ]
    assert offenders == []


def test_fp8route_imports_without_transformers_and_hf_says_how_to_get_it():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import fp8route, fp8route.loading, fp8route.cli\n"
        "try:\n    import fp8route.hf\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'fp8route[transformers]'" in out.stdout
