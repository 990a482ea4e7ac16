"""Per-row logits processing and sampling for a whole batch in one set of tensor ops.

Order per row: raw logits → (logprobs are taken here, from the raw model distribution)
→ presence/frequency penalties → logit_bias → temperature (0 = argmax) → top_p → draw.
Each row draws from its own `random.Random` (seeded from the request's seed), one uniform
per step, and samples by inverse CDF: a row's tokens depend only on its own logits and
its own generator, never on which other rows share the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    logprobs: int | None  # top-k wanted per position, None = no logprobs
    rng: random.Random

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class StepOut:
    tokens: list[int]
    chosen_logprobs: list[float]
    top_ids: list[list[int]] | None  # per row, the max k over rows (callers cut to their k)
    top_logprobs: list[list[float]] | None


class BatchSampler:
    """Tensors for one batch composition; rebuild it whenever rows join or leave."""

    def __init__(self, rows: list[RowParams], vocab: int, device: torch.device) -> None:
        self.rows = rows
        self.vocab = vocab
        self.greedy = torch.tensor([r.temperature == 0.0 for r in rows], device=device)
        self.any_sample = not bool(self.greedy.all()) if rows else False
        self.temperature = torch.tensor(
            [r.temperature or 1.0 for r in rows], dtype=torch.float32, device=device
        )
        self.top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
        nucleus = [i for i, r in enumerate(rows) if r.top_p < 1.0 and r.temperature > 0.0]
        self.any_top_p = bool(nucleus)
        # Only nucleus rows pay for the vocabulary sort.
        self.nucleus_rows = torch.tensor(nucleus, dtype=torch.long, device=device)
        self.presence = torch.tensor(
            [r.presence_penalty for r in rows], dtype=torch.float32, device=device
        )
        self.frequency = torch.tensor(
            [r.frequency_penalty for r in rows], dtype=torch.float32, device=device
        )
        self.any_penalty = any(r.penalised for r in rows)
        self.bias: torch.Tensor | None = None
        if any(r.logit_bias for r in rows):
            self.bias = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
            for i, r in enumerate(rows):
                for tok, b in r.logit_bias.items():
                    self.bias[i, tok] = b
        self.max_k = max((r.logprobs for r in rows if r.logprobs is not None), default=-1)

    def step(self, logits: torch.Tensor, counts: torch.Tensor | None) -> StepOut:
        """Choose one token per row from `logits` [rows, vocab]."""
        logits = logits.float()
        raw_lp = torch.log_softmax(logits, dim=-1)
        adj = logits
        if self.any_penalty and counts is not None:
            adj = (
                adj
                - counts * self.frequency[:, None]
                - (counts > 0).to(adj.dtype) * self.presence[:, None]
            )
        if self.bias is not None:
            adj = adj + self.bias
        tokens = adj.argmax(dim=-1)
        if self.any_sample:
            tokens = torch.where(self.greedy, tokens, self._draw(adj))
        chosen = raw_lp.gather(1, tokens[:, None])[:, 0]
        top_ids = top_lp = None
        if self.max_k > 0:
            vals, ids = raw_lp.topk(self.max_k, dim=-1)
            top_ids, top_lp = ids.tolist(), vals.tolist()
        return StepOut(tokens.tolist(), chosen.tolist(), top_ids, top_lp)

    def _draw(self, adj: torch.Tensor) -> torch.Tensor:
        u = torch.tensor([r.rng.random() for r in self.rows], dtype=torch.float32)
        u = u.to(adj.device)
        probs = torch.softmax(adj / self.temperature[:, None], dim=-1)
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1])[:, None]
        last = probs.shape[-1] - 1
        tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=last)[:, 0]
        if self.any_top_p:
            rows = self.nucleus_rows
            sub, order = probs.index_select(0, rows).sort(dim=-1, descending=True)
            before = sub.cumsum(dim=-1) - sub
            # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
            keep = before < self.top_p.index_select(0, rows)[:, None]
            keep[:, 0] = True
            sub_cdf = (sub * keep).cumsum(dim=-1)
            sub_target = u.index_select(0, rows)[:, None] * sub_cdf[:, -1:]
            idx = torch.searchsorted(sub_cdf, sub_target, right=True).clamp_(max=last)
            tokens[rows] = order.gather(1, idx)[:, 0]
        return tokens


def update_counts(counts: torch.Tensor, tokens: list[int]) -> None:
    """counts[row, token] += 1 for each row's new token (penalties count generated tokens)."""
    if not tokens:
        return
    idx = torch.tensor(tokens, device=counts.device)
    rows = torch.arange(len(tokens), device=counts.device)
    counts.index_put_((rows, idx), torch.ones(len(tokens), device=counts.device), accumulate=True)
