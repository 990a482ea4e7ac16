"""The native decode-attention kernel (platform/csrc/decode_attention.h), built on first use.

SDPA has no variable-length kernel on CPU, so decode attention over rows of different
lengths either reads padding or pays one call per run of rows. This kernel reads each row's
own tokens through its block table in one call per layer. It is part of the engine's CPU
extension (platform/native.py); where that cannot be built the engine keeps its SDPA path,
which gives the same results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchwright.engine.platform import native

# (q, key pool, value pool, block table, lens, scale, *, window=0, softcap=0.0,
# sinks=None, tiles=True) -> out: the engine's paged cache (csrc/decode_attention.h says
# each).
PagedKernel = Callable[..., torch.Tensor]


def paged_attention_kernel() -> PagedKernel | None:
    """The compiled paged kernel (the engine's CPU decode attention), or None."""
    module = native.module()
    if module is None:
        return None
    kernel: PagedKernel = module.paged_decode_attention
    return kernel


def kernel_for(isa: str) -> PagedKernel:
    """The kernel built for instruction set `isa` ("avx512", "avx2", "base"), whatever the
    engine would pick here: tests run every build this CPU can execute."""
    kernel: PagedKernel = native.load(isa).paged_decode_attention
    return kernel
