"""Models that refuse batchwright's attention: padded forwards with transformers' own
SDPA, on the same paged cache.

A prefill runs the admitted prompts left-padded and then stores each prompt's keys and
values in its blocks. A decode step gathers the rows' pages into a padded DynamicCache,
runs one token per row with a mask over each row's own tokens, and stores the new token's
keys and values back. Every step copies the rows' caches, so this path is for
correctness, not speed (tests check it gives the same text as the fast one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from batchwright.engine.attention.backends import gather
from batchwright.engine.kv.manager import Placement
from batchwright.engine.kv.paged import PagedCache
from batchwright.engine.runner.slots import Slots


class ForwardLast(Protocol):
    """A padded forward of transformers' own attention (forward.py's Forward.last)."""

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor: ...


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert keys is not None and values is not None, "only attention KV layers are supported"
        out.append((keys, values))
    return out


def padded_prefill(
    forward: ForwardLast, paged: PagedCache, placed: Sequence[Placement]
) -> torch.Tensor:
    """Logits [prompts, vocab] at each prompt's last token; keys and values stored."""
    dev = paged.device
    width = max(p.length for p in placed)
    ids = torch.zeros((len(placed), width), dtype=torch.long)
    mask = torch.zeros((len(placed), width), dtype=torch.long)
    for i, p in enumerate(placed):
        ids[i, width - p.length :] = torch.tensor(p.unit.prompt)
        mask[i, width - p.length :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = forward(ids, mask, positions, cache)
    dest = torch.tensor([d for p in placed for d in p.dest], device=dev)
    for layer, (k, v) in enumerate(_layers(cache)):
        # [prompts, heads, width, dim] -> each prompt's own tokens as [tokens, heads, dim]
        ks = [k[i, :, width - p.length :].transpose(0, 1) for i, p in enumerate(placed)]
        vs = [v[i, :, width - p.length :].transpose(0, 1) for i, p in enumerate(placed)]
        paged.write(layer, torch.cat(ks), torch.cat(vs), dest)
    return logits


def padded_decode(forward: ForwardLast, paged: PagedCache, slots: Slots, n: int) -> torch.Tensor:
    """One decode step for slots [0, n) (dead slots attend to their new token only).

    Each row's pages are gathered left-padded (its tokens end where the new token goes),
    as a padded prefill lays them: transformers' sliding-window masks count distances in
    cache columns, so the columns between a row's last token and the new one must not be
    padding."""
    lens = slots.lens[:n]
    width = max((slots.hlen[i] for i in range(n) if slots.seqs[i] is not None), default=0)
    cols = torch.arange(width, device=lens.device)[None, :]
    pad = width - lens[:, None]  # [n, 1] padding columns before each row's tokens
    source = (cols - pad).clamp(min=0)  # [n, width] the row's token in each column
    cache = DynamicCache()
    for layer in range(len(paged.keys)):
        keys = _right_aligned(gather(paged.keys[layer], paged.table[:n], width, lens), source)
        values = _right_aligned(gather(paged.values[layer], paged.table[:n], width, lens), source)
        cache.update(keys, values, layer)
    full = torch.arange(width + 1, device=lens.device)[None, :]
    mask = (full >= pad).long()
    logits = forward(slots.tokens[:n, None], mask, lens[:, None], cache)
    dest = paged.decode_dest(lens)
    for layer, (k, v) in enumerate(_layers(cache)):
        paged.write(layer, k[:, :, width], v[:, :, width], dest)
    return logits


def _right_aligned(pages: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """[rows, heads, width, dim] with each row's tokens moved to the right end (the
    columns before them are masked)."""
    index = source[:, None, :, None].expand(-1, pages.shape[1], -1, pages.shape[3])
    return pages.gather(2, index)
