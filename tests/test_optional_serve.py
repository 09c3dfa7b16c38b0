"""The server is an optional extra: fp8route imports without it, and `fp8route serve` says how to get it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_optional_transformers import imported_roots

import fp8route

PACKAGE = Path(fp8route.__file__).parent
SERVE_ONLY = {"fastapi", "starlette", "uvicorn", "prometheus_client", "aiohttp", "pydantic"}


# The server, and the HTTP load client `bench serve --url` imports when it runs.
USERS = {Path("serve"), Path("bench/http.py")}


def test_only_fp8route_serve_and_the_http_load_client_import_the_serve_extra():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        roots = imported_roots(path) & SERVE_ONLY
        if roots and not {rel, *rel.parents} & USERS:
            offenders[str(rel)] = sorted(roots)
    assert offenders == {}


def test_fp8route_imports_without_the_extra_and_serve_says_how_to_get_it():
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client', 'aiohttp'):\n"
        "    sys.modules[name] = None\n"
        "import fp8route, fp8route.cli, fp8route.serve\n"
        "from fp8route.cli import main\n"
        "sys.exit(main(['serve', 'smollm2']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert re.fullmatch(
        r"fp8route serve: the server needs the serve extra \((fastapi|uvicorn) is missing\): "
        r"pip install 'fp8route\[serve\]'",
        lines[0],
    ), lines[0]
