"""Prompt attention when the prompt's leading tokens are already in the paged cache.

A prompt that reuses a cached prefix (prefix.py) only computes its remaining tokens; each
of them attends to the cached pages plus the new tokens before it, which the layer has
just written into the prompt's own blocks. So every new token reads its prompt's pages
through the block table, like a decode row whose length is its position plus one:

- `native` (CPU, float32): all new tokens of all such prompts in one call of the native
  paged kernel per layer (one query per table row, as it takes decode rows).
- `reference`: per prompt, its pages gathered and SDPA with a causal mask aligned to the
  end (query j sees keys up to cached + j).
- `varlen` (CUDA): nothing here; the scheduler gives `varlen_attn` the prompt's query
  length and its full key length, and the call is causal from the bottom right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchwright.engine.attention import backends
from batchwright.engine.attention.variants import PLAIN, Variant
from batchwright.engine.attention.variants import attend as attend_variant


@dataclass(eq=False)
class CachedPrompts:
    spans: list[tuple[int, int, int]]  # (start, end) in the packed row, cached tokens
    table: torch.Tensor  # [prompts, max_blocks] int32: each prompt's blocks
    # native: one table row and one length per new token, in packed order
    rows: torch.Tensor | None = None  # [tokens] packed positions
    row_table: torch.Tensor | None = None  # [tokens, max_blocks]
    row_lens: torch.Tensor | None = None  # [tokens] keys each one reads


def plan(spans: Sequence[tuple[int, int, int]], table: torch.Tensor, native: bool) -> CachedPrompts:
    """`spans` of the prompts with a cached prefix and their block-table rows (device)."""
    out = CachedPrompts(list(spans), table)
    if native:
        dev = table.device
        rows = [p for s, e, _ in spans for p in range(s, e)]
        which = [i for i, (s, e, _) in enumerate(spans) for _ in range(s, e)]
        lens = [c + 1 + j for s, e, c in spans for j in range(e - s)]
        out.rows = torch.tensor(rows, device=dev)
        out.row_table = table.index_select(0, torch.tensor(which, device=dev))
        out.row_lens = torch.tensor(lens, device=dev)
    return out


def attend(
    cp: CachedPrompts,
    query: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    result: torch.Tensor,
    scale: float,
    gqa: bool,
    variant: Variant = PLAIN,
) -> None:
    """Write the attention of the prompts' new tokens into `result` [1, tokens, heads,
    dim]; `query` is [1, heads, tokens, dim]."""
    if cp.rows is not None:
        assert cp.row_table is not None and cp.row_lens is not None
        q = query[0].transpose(0, 1).index_select(0, cp.rows).contiguous()
        out = backends.native(q, kpool, vpool, cp.row_table, cp.row_lens, scale, variant)
        result[0].index_copy_(0, cp.rows, out)
        return
    for i, (s, e, cached) in enumerate(cp.spans):
        width = cached + e - s
        keys = backends.gather(kpool, cp.table[i : i + 1], width)
        values = backends.gather(vpool, cp.table[i : i + 1], width)
        cols = torch.arange(width, device=query.device)[None, :]
        last = cached + torch.arange(e - s, device=query.device)[:, None]
        mask = cols <= last
        if variant.window is not None:
            mask &= cols > last - variant.window
        if variant.plain:
            attended = F.scaled_dot_product_attention(
                query[:, :, s:e], keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        else:
            attended = attend_variant(query[:, :, s:e], keys, values, mask, scale, variant, gqa)
        result[:, s:e] = attended.transpose(1, 2)
