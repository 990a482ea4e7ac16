"""The engine package's imports form no circle, type-only and function-level ones
included: the scheduler, runner and output processor are handed what they use (narrow
interfaces), not the engine."""

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


def _module(root: Path, f: Path) -> str:
    parts = f.relative_to(root).with_suffix("").parts
    return (
        ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))
    )


def test_engine_imports_are_acyclic() -> None:
    root = Path(batchwright.engine.__file__).parent
    graph = {_module(root, f): _imports(f) for f in root.rglob("*.py")}
    assert len(graph) > 20
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None
    # The loop's parts sit below the engine that composes them.
    for part in ("scheduling.scheduler", "runner.model_runner", "output.processor"):
        assert order.index(f"{PACKAGE}.{part}") < order.index(f"{PACKAGE}.engine")
