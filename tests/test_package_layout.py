"""The package's shape: no import cycles between its modules, and no import from a lower layer to one above it."""

from __future__ import annotations

import ast
from pathlib import Path

import fp8route

ROOT = Path(fp8route.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every fp8route module this file imports anywhere (functions and TYPE_CHECKING blocks too):
    `from a.b import c` counts as an import of a.b.c when that is a module, else of a.b."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {name for name in found if name in known}


def test_the_import_graph_has_no_cycle():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# What fp8route.kernels may import of fp8route: the bottom modules, which import nothing of fp8route
# but each other (errors, then the FP8 numerics of quant and schemes). The backends, models and engine
# import the kernels, never the reverse.
KERNELS_MAY_IMPORT = {"fp8route.errors", "fp8route.quant", "fp8route.schemes", "fp8route.device"}


def test_the_kernels_import_only_themselves_and_the_bottom_modules():
    known = modules()
    kernels = {name: path for name, path in known.items() if name.split(".")[:2] == ["fp8route", "kernels"]}
    assert "fp8route.kernels.decode_gemm.launch" in kernels and "fp8route.kernels.argmax" in kernels
    outside = {
        name: sorted(dep for dep in imports(path, known) if dep not in kernels and dep not in KERNELS_MAY_IMPORT)
        for name, path in kernels.items()
    }
    assert not any(outside.values()), {name: deps for name, deps in outside.items() if deps}
    for bottom in KERNELS_MAY_IMPORT:
        assert imports(known[bottom], known) <= KERNELS_MAY_IMPORT - {bottom}, bottom


def test_nothing_outside_the_kernels_defines_a_triton_kernel():
    jit = {name for name, path in modules().items() if "triton.jit" in path.read_text()}
    assert jit and all(name.startswith("fp8route.kernels.") for name in jit), sorted(jit)


# Lower layer -> the packages above it that it must not import: the model definition knows no
# checkpoint folder, and reading or writing one knows no engine; loading a checkpoint into a
# model (fp8route.loading) stands above both.
_BELOW = {
    "fp8route.models": ("fp8route.checkpoint", "fp8route.loading", "fp8route.engine"),
    "fp8route.checkpoint": ("fp8route.loading", "fp8route.engine"),
}


def test_lower_layers_import_nothing_above_them():
    known = modules()
    climbing = [
        f"{name} imports {dep}"
        for name, path in known.items()
        for lower, above in _BELOW.items()
        if name == lower or name.startswith(lower + ".")
        for dep in sorted(imports(path, known))
        if any(dep == up or dep.startswith(up + ".") for up in above)
    ]
    assert not climbing, "imports that climb a layer:\n" + "\n".join(climbing)
