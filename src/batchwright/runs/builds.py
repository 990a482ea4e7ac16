"""What loading a model builds on first use, so the run can say so before going quiet."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from batchwright.registry import DEMO_MODEL, ModelSpec


def first_use_builds(spec: ModelSpec) -> list[str]:
    """The things loading `spec` will build first (none when they are on disk)."""
    builds = []
    if spec.name == DEMO_MODEL and not (Path(spec.path) / "config.json").exists():
        builds.append("the demo model")
    if spec.native_attention and not _kernel_built():
        builds.append("the attention kernel")
    return builds


def _kernel_built() -> bool:
    from torch.utils.cpp_extension import get_default_build_root

    # torch builds under TORCH_EXTENSIONS_DIR, else in a per-Python/device folder of its root.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or f"{get_default_build_root()}/*"
    return bool(glob.glob(f"{root}/batchwright_decode_attention_*/*.so"))
