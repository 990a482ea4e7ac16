"""The engine's CPU kernels (csrc/: decode attention through the paged cache, the sampling
step, RMSNorm and rotary), one extension compiled on first use.

It is compiled with the machine's C++ compiler through `torch.utils.cpp_extension` (cached
under TORCH_EXTENSIONS_DIR, about 30 s the first time) for the best instruction set this
CPU and torch use; where that fails, callers keep their torch paths, which give the same
results.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_MAIN = _CSRC / "native.cpp"
# The extension's name starts so (runs/builds.py looks for a built one).
PREFIX = "batchwright_native_"
# A build lock older than this was left by a killed build (one takes about 30 s).
_STALE_LOCK_SECONDS = 600

# Builds by instruction set, best first; each is also a subset of the ones before it.
_BUILDS = {
    "avx512": ["-mavx2", "-mfma", "-mavx512f"],
    "avx2": ["-mavx2", "-mfma"],
    "base": [],
}


def _flags(isa: str | None = None) -> tuple[str, list[str]]:
    """Build name suffix and compiler flags: the best this CPU and torch use, or `isa`.
    The loops are partly bound by arithmetic, so AVX2 with FMA is worth about 25 % where
    torch itself uses it; the name keeps builds for different instruction sets apart."""
    if isa is None:
        capability = torch.backends.cpu.get_cpu_capability().lower()
        isa = capability if capability in _BUILDS else "base"
    # No contracting a * b + c into an FMA: the elementwise kernels round as ATen does (the
    # loops that want FMAs write them).
    return isa, ["-O3", "-fopenmp", "-ffp-contract=off", *_BUILDS[isa]]


@lru_cache(maxsize=1)
def module() -> ModuleType | None:
    """The extension for this CPU, built if it is not on disk yet; None where it cannot be
    built (no compiler, no headers: logged once)."""
    try:
        return load()
    except Exception as exc:
        log.warning("native CPU kernels unavailable, using torch's: %s", exc)
        return None


def load(isa: str | None = None) -> ModuleType:
    """The extension built for instruction set `isa` ("avx512", "avx2", "base"; None: this
    CPU's best), whatever the engine would pick here: tests run every build this CPU can
    execute."""
    from torch.utils import cpp_extension

    suffix, flags = _flags(isa)
    sources = b"".join(p.name.encode() + p.read_bytes() for p in sorted(_CSRC.iterdir()))
    digest = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()[:10]
    # The sources' hash is in the name, so a built library of that name is these sources.
    name = f"{PREFIX}{suffix}_{digest}"
    build = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build / f"{name}.so"
    if library.exists():
        # Import it directly: cpp_extension.load takes a lock file on every call, and a
        # worker killed while holding it would block every later load.
        spec = importlib.util.spec_from_file_location(name, library)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    lock = build / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    built = cpp_extension.load(
        name=name, sources=[str(_MAIN)], extra_cflags=flags, extra_include_paths=[str(_CSRC)]
    )
    assert isinstance(built, ModuleType)
    return built
