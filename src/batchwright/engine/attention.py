"""Variable-length attention: one forward carries the decode step and the prompts being
admitted, with no padding anywhere in the linear layers.

The model runs with `attn_implementation="batchwright"`. Before a forward the scheduler
sets a `Step` plan; without one (prompt scoring, anything else) this is plain SDPA with
the mask transformers builds.

- Decode rows read the left-padded batch cache; a row's real tokens are its last
  `length` columns. Reading keys and values is the cost (bound by memory bandwidth). On
  CPU in float32 the native kernel (native.py) reads each row's own columns in one call.
  Otherwise a run of neighbouring rows reads the columns of its longest row: on CPU the
  rows are split into the runs that minimise columns read plus a fixed cost per call
  (`decode_runs`); on CUDA each call costs a launch, so runs are fixed and large there.
  Dead slots are skipped.
- Each prompt attends causally to itself only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from batchwright.engine.native import decode_attention_kernel

NAME = "batchwright"
# Attention variants some architectures pass per layer that this implementation lacks.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


Run = tuple[int, int, int]  # rows [start, end) attending over their last `width` columns


@dataclass(eq=False)
class Step:
    """One forward over a single packed row: `rows` decode tokens (one per batch row, in
    slot order) followed by the prompts being admitted, back to back.

    The forward runs without a transformers cache: this attention appends each decode
    token's key and value to the batch cache itself and keeps the prompts' keys and values
    in `captured` (per layer) for the scheduler to place into the batch afterwards.
    """

    rows: int
    cache: Any  # the batch's DynamicCache of _GrowLayers; unused when rows == 0
    runs: list[Run]  # decode rows [start, end) over their last `width` columns; rows in no
    # run are dead slots, whose output is zero
    masks: list[torch.Tensor | None]  # per run, [rows, 1, 1, width]; None when all full
    bounds: list[tuple[int, int]]  # [start, end) of each prompt, counted after the rows
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # With the native kernel: each row's columns (0 = dead slot); runs and masks unused.
    lens: torch.Tensor | None = None


_PLAN: ContextVar[Step | None] = ContextVar("batchwright_attention_plan", default=None)


@contextmanager
def planned(plan: Step | None) -> Iterator[None]:
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def fixed_runs(lengths: list[int], rows: int) -> list[Run]:
    """Runs of `rows` neighbouring rows, each as wide as its longest row."""
    return [
        (a, min(a + rows, len(lengths)), max(lengths[a : a + rows]))
        for a in range(0, len(lengths), rows)
    ]


def decode_runs(lengths: list[int], live: list[bool], call_cost: int, max_run: int) -> list[Run]:
    """Split the decode rows into runs of neighbouring rows, one attention call each.

    A run reads the columns of its longest row for every row in it, so the split trades
    padded reads against calls: it minimises the columns read plus `call_cost` per call
    (an optimal partition by dynamic programming over runs of at most `max_run` rows).
    Runs of dead slots are skipped altogether: nobody reads their output.
    """
    n = len(lengths)
    inf = float("inf")
    best = [0.0] + [inf] * n
    cut = [0] * (n + 1)
    skip = [False] * (n + 1)
    for j in range(1, n + 1):
        if not live[j - 1]:
            # A dead slot can end a skipped stretch for free.
            best[j], cut[j], skip[j] = best[j - 1], j - 1, True
        widest = 0
        for i in range(j - 1, max(-1, j - 1 - max_run), -1):
            widest = max(widest, lengths[i])
            cost = best[i] + (j - i) * widest + call_cost
            if cost < best[j]:
                best[j], cut[j], skip[j] = cost, i, False
    runs: list[Run] = []
    j = n
    while j:
        i = cut[j]
        if not skip[j]:
            runs.append((i, j, max(lengths[i:j])))
        j = i
    runs.reverse()
    return runs


def run_masks(
    runs: list[Run], lengths: list[int], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor | None]:
    """Per run, an additive [rows, 1, 1, width] mask over each row's last `lengths[i]`
    columns (None when every row fills the run). All are views of one right-aligned mask;
    additive rather than boolean because SDPA would convert a boolean mask on every call."""
    if not runs:
        return []
    widest = max(w for _, _, w in runs)
    lens = torch.tensor(lengths, device=device)
    pad = torch.arange(widest, device=device)[None, :] < (widest - lens)[:, None]
    full = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
    masks: list[torch.Tensor | None] = []
    for a, b, w in runs:
        full_rows = all(n >= w for n in lengths[a:b])
        masks.append(None if full_rows else full[a:b, widest - w :, None, None].transpose(1, 3))
    return masks


def best_partner(lens: list[int], x: int, g: int) -> int:
    """The row whose swap with row x narrows their two groups of g rows the most (-1: none)."""
    # Per group: widest row and the width without it.
    top: list[tuple[int, int, int]] = []
    for a in range(0, len(lens), g):
        part = lens[a : a + g]
        i = max(range(len(part)), key=part.__getitem__)
        second = max((v for k, v in enumerate(part) if k != i), default=0)
        top.append((part[i], a + i, second))

    def without(row: int) -> int:
        width, arg, second = top[row // g]
        return second if row == arg else width

    rest_x = without(x)
    best, gain = -1, 0
    for y in range(len(lens)):
        if y // g == x // g:
            continue
        rest_y = without(y)
        before = max(rest_x, lens[x]) + max(rest_y, lens[y])
        after = max(rest_x, lens[y]) + max(rest_y, lens[x])
        if before - after > gain:
            best, gain = y, before - after
    return best


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plan = _PLAN.get()
    if plan is None:
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if unsupported:
        # Silently ignoring a sliding window, logit soft-capping or attention sinks would
        # give wrong text; refuse instead.
        raise NotImplementedError(f"batchwright attention does not support {unsupported}")
    gqa = query.shape[1] != key.shape[1]
    # Built directly in the [1, tokens, heads, dim] layout the model wants back.
    result = query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))
    n = plan.rows
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
    if n:
        layer = plan.cache.layers[layer_idx]
        # [1, heads, rows, dim] -> [rows, heads, 1, dim]: one new column per batch row.
        keys, values = layer.update(
            key[0, :, :n, None].transpose(0, 1), value[0, :, :n, None].transpose(0, 1)
        )
        q = query[0, :, :n].transpose(0, 1)  # [rows, heads, dim]
        if plan.lens is not None:
            kernel = decode_attention_kernel()
            assert kernel is not None, "a plan with lens needs the native kernel"
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            result[0, :n] = kernel(q.contiguous(), keys, values, plan.lens, keys.shape[2], scale)
        else:
            result[0, :n] = _attend_runs(plan, q, keys, values, scaling, gqa)
    if plan.bounds:
        pk, pv = key[:, :, n:], value[:, :, n:]
        plan.captured[layer_idx] = (pk, pv)
        for s, e in plan.bounds:
            attended = F.scaled_dot_product_attention(
                query[:, :, n + s : n + e],
                pk[:, :, s:e],
                pv[:, :, s:e],
                is_causal=e - s > 1,
                scale=scaling,
                enable_gqa=gqa,
            )
            result[:, n + s : n + e] = attended.transpose(1, 2)
    return result, None


def _attend_runs(
    plan: Step,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Decode attention with one SDPA call per run of rows; [rows, heads, dim]."""
    n, heads, dim = q.shape[0], q.shape[1], values.shape[-1]
    cols = keys.shape[2]
    pieces: list[torch.Tensor] = []
    done = 0
    for (a, b, w), mask in zip(plan.runs, plan.masks, strict=True):
        if a > done:  # skipped dead slots: finite, never read
            pieces.append(q.new_zeros((a - done, heads, 1, dim)))
        pieces.append(
            F.scaled_dot_product_attention(
                q[a:b, :, None],
                keys[a:b, :, cols - w :],
                values[a:b, :, cols - w :],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
        done = b
    if done < n:
        pieces.append(q.new_zeros((n - done, heads, 1, dim)))
    return torch.cat(pieces)[:, :, 0]


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    # Under a plan the attention builds its own (much smaller) masks.
    if _PLAN.get() is not None:
        return None
    mask: torch.Tensor | None = sdpa_mask(*args, **kwargs)
    return mask


def register() -> None:
    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)
