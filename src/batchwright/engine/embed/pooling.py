"""Pooling on the device, over a packed row: one vector per input, as sentence-transformers'
Pooling and Normalize modules compute them (its models/Pooling.py, models/Normalize.py),
then Matryoshka truncation. Every mode is a few whole-row tensor ops, none per input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchwright.engine.embed.packing import Pack

MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def _segments(p: Pack, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's input (row order) and whether it is pooled (past a skipped prompt)."""
    n = p.lengths.shape[0]
    seg = torch.repeat_interleave(
        torch.arange(n, device=p.lengths.device), p.lengths, output_size=tokens
    )
    at = torch.arange(tokens, device=seg.device)
    return seg, at >= p.pool_from.index_select(0, seg)


def pool(hidden: torch.Tensor, p: Pack, mode: str) -> torch.Tensor:
    """[tokens, hidden] -> [inputs, hidden] in float32, inputs in the pack's row order."""
    h = hidden.float()
    if mode == "cls":
        # The first pooled token (sentence-transformers: after a prompt left out).
        return h.index_select(0, p.pool_from)
    if mode == "lasttoken":
        return h.index_select(0, p.starts + p.lengths - 1)
    n, width = p.lengths.shape[0], h.shape[1]
    seg, pooled = _segments(p, h.shape[0])
    if mode == "max":
        values = h.masked_fill(~pooled[:, None], float("-inf"))
        out = h.new_full((n, width), float("-inf"))
        return out.scatter_reduce_(0, seg[:, None].expand(-1, width), values, "amax")
    weight = pooled.to(h.dtype)
    if mode == "weightedmean":
        # Weights 1..L by position in the input (the prompt's included), as sentence-
        # transformers counts them.
        first = p.starts.index_select(0, seg)
        weight = weight * (torch.arange(h.shape[0], device=h.device) - first + 1).to(h.dtype)
    sums = h.new_zeros((n, width)).index_add_(0, seg, h * weight[:, None])
    count = h.new_zeros(n).index_add_(0, seg, weight).clamp_(min=1e-9)
    if mode == "mean_sqrt_len_tokens":
        return sums / count.sqrt()[:, None]
    return sums / count[:, None]


def finish(vectors: torch.Tensor, normalize: bool, dims: torch.Tensor | None) -> torch.Tensor:
    """Normalised as the model's Normalize module does; `dims` (per input, 0 = all) keeps
    the first dims of a vector and normalises again, as Matryoshka models are used."""
    if normalize:
        vectors = F.normalize(vectors, p=2, dim=1)
    if dims is not None:
        keep = torch.arange(vectors.shape[1], device=vectors.device)[None, :] < dims[:, None]
        vectors = F.normalize(vectors * keep, p=2, dim=1)
    return vectors
