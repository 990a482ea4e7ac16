"""Process-level memory settings for inference: glibc malloc, and the cyclic collector.

A CPU step allocates and frees many tensors of a few hundred kilobytes (activations,
logits). glibc serves blocks above its mmap threshold (128 KiB at start) with a fresh
mmap each time, so every such tensor costs page faults and zeroing, and the threshold
then moves with whatever large block the process happened to free last: the same engine
ran 15-25 % apart between processes on this project's CPU bench (hom leg), with 3-5x the
page faults in the slow ones. Fixing the thresholds keeps those blocks in the heap: far
fewer faults and the same speed in every process (docs/engine.md has the figures).

Applied once per process when a model is loaded on CPU, unless the operator set glibc's
own MALLOC_* variables (theirs win). Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap (glibc's dynamic threshold tops out here anyway).
MMAP_THRESHOLD = 32 << 20
# Free heap memory above this is returned to the system.
TRIM_THRESHOLD = 128 << 20

_done = False


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds; True when applied."""
    global _done
    if _done or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and ok
    _done = ok
    return ok


def freeze_heap() -> None:
    """Take what is alive now (imported modules, the model's Python objects, the
    tokenizer) out of the cyclic collector's view, after one last collection.

    A loaded model leaves about 400,000 objects tracked, and every full collection walks
    them all: on the demo model one took 0.12-0.16 s, once per 2,000-line run, about 10 %
    of the run. Objects allocated later are collected as before, and anything freed by
    its reference count is still freed; only cycles among what exists now are never
    looked at again."""
    gc.collect()
    gc.freeze()
