"""What loading a model builds on first use, built here one at a time so that the run can
say what it is building and for how long (the engine then finds both on disk)."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchwright.registry import DEMO_MODEL, ModelSpec
from batchwright.worker.generation import runner


@dataclass(frozen=True)
class Build:
    what: str  # "the demo model", "the CPU kernels"
    run: Callable[[], bool]  # True when built (the kernels may fail: the engine keeps torch's)


def first_use_builds(spec: ModelSpec) -> list[Build]:
    """The things loading `spec` will build first (none when they are on disk)."""
    builds = []
    if spec.name == DEMO_MODEL and not (Path(spec.path) / "config.json").exists():
        builds.append(Build("the demo model", lambda: _demo_model(spec)))
    if _kernel_wanted(spec) and not _kernel_built():
        builds.append(Build("the CPU kernels", _kernel))
    return builds


def _demo_model(spec: ModelSpec) -> bool:
    from batchwright.engine.loading.demo import ensure_demo_model

    ensure_demo_model(spec.path)
    return True


def _kernel() -> bool:
    from batchwright.engine.platform import native

    # Ctrl-C reaches the compiler too (one process group), and the engine would then log
    # that the kernels are unavailable "interrupted by user": the run is stopping, say nothing.
    engine_log = logging.getLogger(native.__name__)
    quiet = _WhileRunning()
    engine_log.addFilter(quiet)
    try:
        return native.module() is not None
    finally:
        engine_log.removeFilter(quiet)


class _WhileRunning(logging.Filter):
    """Lets records through unless the run was interrupted."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not runner.SHUTDOWN.is_set()


def _kernel_wanted(spec: ModelSpec) -> bool:
    """The engine's condition: generation models on the CPU (the sampler's step,
    engine/sampling/native.py, and for float32 the decode attention); an embedding model
    decodes nothing and never loads them."""
    if spec.kind == "embed":
        return False
    if spec.device != "auto":
        return spec.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _kernel_built() -> bool:
    from torch.utils.cpp_extension import get_default_build_root

    from batchwright.engine.platform.native import PREFIX

    # torch builds under TORCH_EXTENSIONS_DIR, else in a per-Python/device folder of its root.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or f"{get_default_build_root()}/*"
    return bool(glob.glob(f"{root}/{PREFIX}*/*.so"))
