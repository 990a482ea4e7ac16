"""The CPU sampling step as one native call (platform/csrc/sample_rows.h).

Eager on CPU every op of the graph in sample_step.py is a pass of its own over [B, vocab]:
about 25 of them in a step with a sampled row (6 ms at 64 rows of a 4,096-token vocabulary,
two thirds of it in two top-k and the histogram), and ATen's CPU top-k and max with
indices are slow at these shapes. The kernel takes one row at a time while its scores sit
in cache, with the graph's semantics (the same nucleus, the same inverse CDF in vocabulary
order from the row's uniform, the same state updates), for greedy and sampled rows alike:
the same tokens as the graph but where a uniform falls within float32's rounding of a
token's edge (its running sums are in double).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchwright.engine.platform import native


def native_step() -> Callable[..., torch.Tensor] | None:
    """`sample_step`'s signature and result, computed by the kernel; None where the CPU
    extension cannot be built (the torch graphs then serve)."""
    module = native.module()
    if module is None:
        return None
    kernel = module.sample_rows

    def step(
        logits: torch.Tensor,
        offset: torch.Tensor,
        counts: torch.Tensor,
        inv_t: torch.Tensor,
        greedy: torch.Tensor,
        top_p: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        ring: torch.Tensor,
        cursor: torch.Tensor,
        tables: Any,
        k_top: int,
        allow: torch.Tensor | None = None,
    ) -> torch.Tensor:
        packed: torch.Tensor = kernel(
            logits.float(),
            offset,
            counts,
            inv_t,
            greedy,
            top_p,
            presence,
            frequency,
            ring,
            cursor,
            allow,
            k_top,
        )
        return packed

    return step
