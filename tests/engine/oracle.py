"""The sampler's oracle: BatchSampler, the straightforward per-batch sampler the engine ran
before sampler.py, kept as the reference the fixed-shape sampler is tested against (the
same semantics: engine/sampling/params.py)."""

from __future__ import annotations

import torch

from batchwright.engine.sampling.params import TEMPERATURE_EPSILON, RowParams, StepOut

# The nucleus boundary is first looked for among each row's _TOP most likely tokens (one
# small top-k); rows whose nucleus is wider use log-probability buckets, 32 nats deep.
_TOP = 64
_BINS = 256
_PER_NAT = 8


class BatchSampler:
    """Tensors for one batch composition; rebuild it whenever rows join or leave.

    Each kind of work touches only the rows that asked for it: penalties, sampling (greedy
    rows just take the argmax), the nucleus search and top-k logprobs.
    """

    def __init__(self, rows: list[RowParams], vocab: int, device: torch.device) -> None:
        self.rows = rows
        self.vocab = vocab

        def index(ids: list[int]) -> torch.Tensor:
            return torch.tensor(ids, dtype=torch.long, device=device)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        self.sampled = [i for i, r in enumerate(rows) if r.temperature >= TEMPERATURE_EPSILON]
        self.sampled_rows = index(self.sampled)
        self.greedy_rows = index(
            [i for i, r in enumerate(rows) if r.temperature < TEMPERATURE_EPSILON]
        )
        self.temperature = floats([rows[i].temperature for i in self.sampled])
        nucleus = [j for j, i in enumerate(self.sampled) if rows[i].top_p < 1.0]
        self.nucleus = index(nucleus)  # positions among the sampled rows
        self.top_p = floats([rows[self.sampled[j]].top_p for j in nucleus])
        penalised = [i for i, r in enumerate(rows) if r.penalised]
        self.penalised = index(penalised)
        self.presence = floats([rows[i].presence_penalty for i in penalised])
        self.frequency = floats([rows[i].frequency_penalty for i in penalised])
        self.bias: torch.Tensor | None = None
        if any(r.logit_bias for r in rows):
            self.bias = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
            for i, r in enumerate(rows):
                for tok, b in r.logit_bias.items():
                    self.bias[i, tok] = b
        self.scored = [i for i, r in enumerate(rows) if r.logprobs]
        self.scored_rows = index(self.scored)
        self.max_k = max((rows[i].logprobs or 0 for i in self.scored), default=0)

    def step(self, logits: torch.Tensor, counts: torch.Tensor | None) -> StepOut:
        """Choose one token per row from `logits` [rows, vocab]."""
        logits = logits.float()
        raw_lp = torch.log_softmax(logits, dim=-1)
        adj = logits
        if self.bias is not None:
            adj = logits + self.bias
        if len(self.penalised) and counts is not None:
            adj = adj.clone() if adj is logits else adj
            c = counts.index_select(0, self.penalised)
            pen = c * self.frequency[:, None] + (c > 0).to(c.dtype) * self.presence[:, None]
            adj.index_add_(0, self.penalised, pen, alpha=-1.0)
        # max() rather than argmax(): the same first maximal index, several times faster on
        # CPU; and only the greedy rows take it.
        if not self.sampled:
            tokens = adj.max(dim=-1).indices
        elif len(self.sampled) == len(self.rows):
            tokens = self._draw(adj)
        else:
            tokens = torch.empty(len(self.rows), dtype=torch.long, device=adj.device)
            tokens[self.greedy_rows] = adj.index_select(0, self.greedy_rows).max(dim=-1).indices
            tokens[self.sampled_rows] = self._draw(adj.index_select(0, self.sampled_rows))
        # Logprobs come from the raw logits.
        chosen = raw_lp.gather(1, tokens[:, None])[:, 0]
        top_ids: list[list[int]] | None = None
        top_lp: list[list[float]] | None = None
        if self.scored:
            top_ids, top_lp = [[] for _ in self.rows], [[] for _ in self.rows]
            vals, ids = raw_lp.index_select(0, self.scored_rows).topk(self.max_k, dim=-1)
            for i, row_ids, row_vals in zip(self.scored, ids.tolist(), vals.tolist(), strict=True):
                top_ids[i], top_lp[i] = row_ids, row_vals
        return StepOut(tokens.tolist(), chosen.tolist(), top_ids, top_lp)

    def _draw(self, adj: torch.Tensor) -> torch.Tensor:
        """Sample each of the sampled rows (`adj` holds just those) with its own generator."""
        u = torch.tensor([self.rows[i].rng.random() for i in self.sampled], dtype=torch.float32)
        u = u.to(adj.device)
        probs = torch.softmax(adj / self.temperature[:, None], dim=-1)
        if len(self.nucleus):
            rows = self.nucleus
            sub = probs.index_select(0, rows)
            floor = _nucleus_floor(sub, self.top_p)
            probs[rows] = sub * (sub >= floor)
        # Inverse CDF in vocabulary order: exact for the (possibly truncated) distribution
        # and cheap, as nothing but the nucleus boundary needs a sort.
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1])[:, None]
        last = probs.shape[-1] - 1
        return torch.searchsorted(cdf, target, right=True).clamp_(max=last)[:, 0]


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability inside the nucleus: the smallest set of most likely
    tokens whose mass reaches top_p (the top token always stays; ties at the boundary all
    stay).

    A full sort of the vocabulary is the slow part of nucleus sampling. Most nuclei are
    narrow, so the boundary is first read off each row's few most likely tokens; only rows
    whose nucleus reaches past them take the bucketed search.
    """
    k = min(_TOP, probs.shape[-1])
    vals = probs.topk(k, dim=-1).values
    mass = vals.cumsum(dim=-1)
    kept = ((mass - vals) < top_p[:, None]).sum(dim=-1).clamp_(min=1)
    floor = vals.gather(1, (kept - 1)[:, None])
    # Rows whose top k hold less than top_p (and no boundary at all: rows with top_p 0
    # stopped at the top token above).
    wide = (mass[:, -1] < top_p).nonzero()[:, 0]
    if len(wide):
        floor[wide] = _bucket_floor(probs.index_select(0, wide), top_p.index_select(0, wide))
    return floor


def _bucket_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_nucleus_floor` for wide nuclei: the tokens are bucketed by log-probability, whole
    buckets above the boundary are in, buckets below are out, and only the boundary bucket
    is sorted."""
    rows = probs.shape[0]
    logp = torch.log(probs / probs.amax(dim=-1, keepdim=True))
    # Bucket _BINS - 1 holds the top token; each bucket spans 1/_PER_NAT nats.
    bucket = (logp * _PER_NAT + _BINS - 1).floor_().clamp_(min=0).long()
    mass = probs.new_zeros((rows, _BINS)).scatter_add_(1, bucket, probs)
    # above[b]: mass of all more likely buckets. The boundary is the lowest bucket whose
    # tokens can still start below top_p (above is non-increasing in b).
    above = mass.flip(-1).cumsum(-1).flip(-1) - mass
    starts_below = above < top_p[:, None]
    edge = starts_below.to(torch.int8).argmax(dim=-1, keepdim=True)
    # top_p 0: no bucket qualifies, and only the top token stays.
    edge = torch.where(starts_below.any(dim=-1, keepdim=True), edge, _BINS - 1)
    inside = bucket == edge
    k = max(1, int(inside.sum(dim=-1).max()))
    vals = torch.where(inside, probs, -1.0).topk(k, dim=-1).values
    before = above.gather(1, edge) + vals.clamp(min=0).cumsum(dim=-1) - vals.clamp(min=0)
    kept = ((before < top_p[:, None]) & (vals >= 0)).sum(dim=-1).clamp_(min=1)
    # An empty boundary bucket (the whole row's mass rounds below top_p): keep everything.
    return vals.gather(1, (kept - 1)[:, None]).clamp_(min=0.0)


def update_counts(counts: torch.Tensor, tokens: list[int]) -> None:
    """counts[row, token] += 1 for each row's new token (penalties count generated tokens)."""
    if not tokens:
        return
    idx = torch.tensor(tokens, device=counts.device)
    rows = torch.arange(len(tokens), device=counts.device)
    counts.index_put_((rows, idx), torch.ones(len(tokens), device=counts.device), accumulate=True)
