"""Variable-length attention over the paged cache: one forward carries the decode step of
every batch row and the prompts being admitted, with no padding in the linear layers.

The model runs with `attn_implementation="batchwright"`. Before a forward the scheduler
sets a `Step` plan; without one (prompt scoring, anything else) this is plain SDPA with
the mask transformers builds. Under a plan each layer first writes every token's key and
value into the paged cache (paged.py) at the positions the plan gives, then attends:

- `varlen` (CUDA, fp16/bf16): one `varlen_attn` call per layer through the block table,
  decode rows and prompts together (causal, bottom-right aligned).
- `native` (CPU, float32): decode rows by the C++ kernel reading pages (native.py), one
  call per layer; each prompt attends causally to its own tokens with SDPA.
- `reference` (anywhere): decode rows gather their pages in runs of rows of similar
  length and run SDPA (`decode_runs` picks the runs on CPU); prompts as above. Tests
  compare it with the other two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchwright.engine.attention import backends, prefix_attention, registration, variants
from batchwright.engine.kv.paged import PagedCache

NAME = "batchwright"


Run = tuple[int, int, int]  # rows [start, end) attending over their first `width` tokens


@dataclass(eq=False)
class Step:
    """One forward over a single packed row: `rows` decode tokens (one per batch slot, in
    slot order) followed by the prompts being admitted, back to back."""

    cache: PagedCache
    rows: int
    dest: torch.Tensor  # [tokens] flat pool position of each token's key and value
    bounds: list[tuple[int, int]]  # [start, end) of each prompt, counted after the rows
    backend: str  # "varlen" | "native" | "reference"
    lens: torch.Tensor | None = None  # native: tokens each decode row reads (0 = dead)
    runs: list[Run] = field(default_factory=list)  # reference: decode runs
    run_lens: list[int] = field(default_factory=list)  # reference: tokens per decode row
    varlen: backends.VarlenArgs | None = None
    # Prompts whose leading tokens are cached (not in `bounds`): prefix_attention.py.
    cached: prefix_attention.CachedPrompts | None = None
    pad: int = 0  # tokens at the end of the row that nobody reads


_PLAN: ContextVar[Step | None] = ContextVar("batchwright_attention_plan", default=None)
# Set while the loader probes the model (model_support.py): each call without a plan is
# reported as (module, query, key, value, keyword arguments).
PROBE: ContextVar[Any] = ContextVar("batchwright_attention_probe", default=None)
# The model's forward hands its keyword arguments down to the attention: a compiled
# forward (compiled.py) passes the plan this way, since torch.compile cannot read a
# ContextVar.
PLAN_KWARG = "batchwright_plan"


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

    A run reads the tokens of its longest row for every row in it, so the split trades
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
    plan: Step | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        plan = _PLAN.get()
    if plan is None:
        probe = PROBE.get()
        if probe is not None:
            probe(module, query, key, value, kwargs)
        variant = variants.variant_of(kwargs)
        if variant.plain:
            kwargs.pop("sliding_window", None)  # the mask transformers built holds it
            out: tuple[torch.Tensor, None] = sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
            return out
        # Soft-capping and sinks, which SDPA lacks, over the mask transformers built.
        allowed = attention_mask
        if allowed is not None and allowed.dtype != torch.bool:
            allowed = allowed > torch.finfo(allowed.dtype).min / 2
        causal = allowed is None and query.shape[2] > 1
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        attended = variants.attend(
            query,
            key,
            value,
            allowed,
            scale,
            variant,
            query.shape[1] != key.shape[1],
            causal=causal,
        )
        return attended.transpose(1, 2), None
    gqa = query.shape[1] != key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    cache = plan.cache
    variant = variants.variant_of(kwargs, cache.capacity)
    # [1, heads, tokens, dim] -> [tokens, heads, dim]
    cache.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), plan.dest)
    pools = cache.keys[layer], cache.values[layer]
    q = query[0].transpose(0, 1)
    if plan.backend == "varlen":
        assert plan.varlen is not None
        return backends.varlen(q, *pools, plan.varlen, scale, gqa, variant)[None], None
    # Built directly in the [1, tokens, heads, dim] layout the model wants back.
    result = query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))
    n = plan.rows
    if n:
        if plan.backend == "native":
            assert plan.lens is not None
            result[0, :n] = backends.native(
                q[:n].contiguous(), *pools, cache.table, plan.lens, scale, variant
            )
        else:
            result[0, :n] = backends.reference(
                q[:n], *pools, cache.table, plan.runs, plan.run_lens, scale, gqa, variant
            )
    for s, e in plan.bounds:
        # A prompt's keys and values are its own tokens: no need to read them back.
        attended = variants.own_tokens(
            query[:, :, n + s : n + e],
            key[:, :, n + s : n + e],
            value[:, :, n + s : n + e],
            scale,
            variant,
            gqa,
        )
        result[:, n + s : n + e] = attended.transpose(1, 2)
    if plan.cached is not None:
        prefix_attention.attend(plan.cached, query, *pools, result, scale, gqa, variant)
    if plan.pad:
        result[0, -plan.pad :] = 0
    return result, None


def register() -> None:
    registration.register(NAME, attention, _PLAN)
