"""One of batchwright's attentions made known to transformers under its name, with the
mask function that goes with it (interface.py's over the paged cache, embed/attention.py's
over packed inputs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

Mask = Callable[..., torch.Tensor | None]


def register(name: str, attention: Callable[..., Any], plan: ContextVar[Any]) -> None:
    """`attn_implementation=name` runs `attention`, with `plan`'s mask function."""
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, _mask_for(plan))


# One function per plan variable, whatever the number of loads: a compiled forward that
# found it in transformers' registry finds the same one there after another model loads.
@functools.cache
def _mask_for(plan: ContextVar[Any]) -> Mask:
    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        # Under a plan the attention needs no mask of transformers'; without one (prompt
        # scoring, a probe) it runs as SDPA, with SDPA's mask.
        if plan.get() is not None:
            return None
        built: torch.Tensor | None = sdpa_mask(*args, **kwargs)
        return built

    return mask
