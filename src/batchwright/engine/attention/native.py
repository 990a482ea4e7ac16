"""The native decode-attention kernel (csrc/decode_attention.cpp), built on first use.

SDPA has no variable-length kernel on CPU, so decode attention over rows of different
lengths either reads padding or pays one call per run of rows. This kernel reads each row's
own tokens through its block table in one call per layer. It is compiled with the
machine's C++ compiler through `torch.utils.cpp_extension` (cached under
TORCH_EXTENSIONS_DIR, about 30 s the first time); where that fails the engine keeps its
SDPA path, which gives the same results.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
# A build lock older than this was left by a killed build (one takes about 30 s).
_STALE_LOCK_SECONDS = 600

# (q, key pool, value pool, block table, lens, scale, *, window=0, softcap=0.0,
# sinks=None, tiles=True) -> out: the engine's paged cache (csrc/decode_attention.cpp
# says each).
PagedKernel = Callable[..., torch.Tensor]


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
    return isa, ["-O3", "-fopenmp", *_BUILDS[isa]]


@lru_cache(maxsize=1)
def _module() -> ModuleType | None:
    try:
        return _load()
    except Exception as exc:  # no compiler, no headers, a failed build: keep SDPA
        log.warning("native decode attention unavailable, using SDPA: %s", exc)
        return None


def paged_attention_kernel() -> PagedKernel | None:
    """The compiled paged kernel (the engine's CPU decode attention), or None."""
    module = _module()
    if module is None:
        return None
    kernel: PagedKernel = module.paged_decode_attention
    return kernel


def kernel_for(isa: str) -> PagedKernel:
    """The kernel built for instruction set `isa` ("avx512", "avx2", "base"), whatever the
    engine would pick here: tests run every build this CPU can execute."""
    kernel: PagedKernel = _load(isa).paged_decode_attention
    return kernel


def _load(isa: str | None = None) -> ModuleType:
    from torch.utils import cpp_extension

    suffix, flags = _flags(isa)
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    # The source's hash is in the name, so a built library of that name is this source.
    name = f"batchwright_decode_attention_{suffix}_{digest}"
    build = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build / f"{name}.so"
    if library.exists():
        # Import it directly: cpp_extension.load takes a lock file on every call, and a
        # worker killed while holding it would block every later load.
        spec = importlib.util.spec_from_file_location(name, library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    lock = build / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    module = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=flags)
    assert isinstance(module, ModuleType)
    return module
