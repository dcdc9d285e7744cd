"""The package's shape, as the README's layout section and the package docstrings describe it:
imports point one way, down the layers, with no cycle; classes and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Bottom first. A module may import its own package, a lower layer, and `pipeline` itself (the
# version); packages in one layer do not import each other.
LAYERS = [
    ("pipeline.model", "pipeline.observability"),
    ("pipeline.decoding",),
    ("pipeline.protocol",),
    ("pipeline.workers", "pipeline.orchestration", "pipeline.audit", "pipeline.api", "pipeline.service"),
    ("pipeline.training",),
    ("pipeline.bench",),
    ("pipeline.cli",),
    ("lanes",),
]
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 60


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "lanes").rglob("*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every package module this file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out.update(n for n in [node.module, *names] if n.split(".")[0] in ("pipeline", "lanes"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in ("pipeline", "lanes"))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (the layers are checked on absolute names)")
    known = modules()
    return {name for name in out if name in known}


def layer_of(module: str) -> tuple[int, str]:
    for index, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return index, package
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to the README's layout")


GRAPH = {name: imports(path) for name, path in modules().items()}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != "pipeline"))
def test_imports_point_down_the_layers(module):
    layer, package = layer_of(module)
    for target in GRAPH[module]:
        if target == "pipeline":
            continue
        target_layer, target_package = layer_of(target)
        assert target_package == package or target_layer < layer, f"{module} imports {target} (up or across)"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in GRAPH.get(module, ()):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] if target in path else path
                raise AssertionError(" -> ".join([*cycle, target]))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module, [module])


def test_classes_and_functions_are_small_or_say_why():
    too_big = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            limit = (
                MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                else MAX_FUNCTION_LINES if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else None
            )  # fmt: skip
            if limit is None or node.end_lineno - node.lineno + 1 <= limit:
                continue
            head = lines[node.lineno : node.body[0].lineno - 1]  # between the signature and the body
            if not any(line.strip().startswith("#") and "lines" in line for line in head):  # says why
                too_big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big


def test_every_package_says_what_it_holds():
    for name, path in modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 40 and "TODO" not in doc, f"{name} needs a docstring that maps it"
