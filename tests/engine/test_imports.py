"""The engine package's imports form no circle, type-only and function-level ones
included: the batching loop is handed what it uses (engine/parts.py), not the engine."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import batchwright.engine

PACKAGE = "batchwright.engine"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            out |= {f"{PACKAGE}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            out.add(str(node.module))
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
    return out


def test_engine_imports_are_acyclic() -> None:
    root = Path(batchwright.engine.__file__).parent
    graph = {f"{PACKAGE}.{f.stem}": _imports(f) for f in root.glob("*.py")}
    assert len(graph) > 20
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None
    # The loop sits below the engine that composes it.
    assert order.index(f"{PACKAGE}.scheduler") < order.index(f"{PACKAGE}.runtime")
