"""The native decode-attention kernel (csrc/decode_attention.cpp), built on first use.

SDPA has no variable-length kernel on CPU, so decode attention over rows of different
lengths either reads padding or pays one call per run of rows. This kernel reads each row's
own columns in one call per layer. It is compiled with the machine's C++ compiler through
`torch.utils.cpp_extension` (cached under TORCH_EXTENSIONS_DIR, about 30 s the first time);
where that fails the engine keeps its SDPA path, which gives the same results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"

# (q, keys, values, lens, cols, scale) -> out; see the source for the layouts.
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


def _flags() -> tuple[str, list[str]]:
    """Build name suffix and compiler flags for this CPU. The loops are partly bound by
    arithmetic, so AVX2 with FMA is worth about 25 % where torch itself uses it; the name
    keeps builds for different instruction sets apart in a shared cache."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    flags = ["-O3", "-fopenmp"]
    if capability in ("avx2", "avx512"):
        flags += ["-mavx2", "-mfma"]
        return "avx2", flags
    return "base", flags


@lru_cache(maxsize=1)
def decode_attention_kernel() -> Kernel | None:
    """The compiled kernel, or None where it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        suffix, flags = _flags()
        module = load(
            name=f"batchwright_decode_attention_{suffix}",
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a failed build: keep SDPA
        log.warning("native decode attention unavailable, using SDPA runs: %s", exc)
        return None
    kernel: Kernel = module.decode_attention
    return kernel
