"""The tensor work of one sampling step, as pure functions (see sampler.py for the design).

`sample_step` is the one fixed graph; `greedy_step` and `plain_step` are CPU shortcuts for
batches without sampled rows. All three end in `_finish` (state updates, the packed
result) and run under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Candidates read off the adjusted logits (the nucleus of most rows fits in them).
_CANDIDATES = 64
# Log-probability bins below the C-th candidate, _PER_NAT per nat, 32 nats deep (tails that
# far down rarely hold mass that matters); the last bin is a catch-all.
_BINS = 512
_PER_NAT = 16
# Uniforms held per slot on the device; a slot's ring is topped up every _RING/2 steps.
_RING = 64
# Uniforms are kept below 1 by this much so u * total stays below total in float32.
_BELOW_ONE = 1.0 - 2.0**-23
# The score of a token a grammar forbids (see `masked`).
_FORBIDDEN = -1e30
# In a step with constrained rows, exponentials of log-probabilities below this are taken
# at it (1.6e-38, float32's smallest normal): ATen's CPU exp leaves its vector path for
# inputs that underflow and is 40-150x slower on them, and a grammar's forbidden tokens
# are most of a constrained row. Only masses summed into the histogram and the
# candidates' nucleus are floored; the weights of the drawn block stay exact, so a
# forbidden token's is 0. Steps without a grammar keep their ops (the fixed graph's count).
_EXP_FLOOR = -87.0


class Tables(NamedTuple):
    """Constant index tables of one vocabulary (built once per Sampler)."""

    cells: torch.Tensor  # [vocab] float: first cell of each token's block in the table
    block_ids: torch.Tensor  # [blocks, block] long: token ids per block (padded with vocab-1)
    block_valid: torch.Tensor  # [blocks, block] float: 1 for real ids, 0 for padding
    bins: torch.Tensor  # [1, _BINS] long: 0 .. _BINS-1
    ones: torch.Tensor  # [capacity] float: a count of one per row
    rows: torch.Tensor  # [capacity] long: 0 .. capacity-1
    word: torch.Tensor  # [vocab] long: the bitmask word of each token (grammar.py)
    bit: torch.Tensor  # [vocab] int32: its bit in that word, as a mask (1 << bit)


def make_tables(vocab: int, capacity: int, device: torch.device) -> Tables:
    # The table ([blocks * _BINS] per row) and the block read by the draw cost about the
    # same: sqrt(vocab / _BINS) blocks.
    n = max(1, min(round(math.sqrt(vocab / _BINS)), 256))
    size = -(-vocab // n)
    blocks = -(-vocab // size)
    ids = torch.arange(blocks * size, device=device).view(blocks, size)
    return Tables(
        cells=(torch.arange(vocab, device=device) // size * _BINS).float(),
        block_ids=ids.clamp(max=vocab - 1),
        block_valid=(ids < vocab).float(),
        bins=torch.arange(_BINS, device=device)[None, :],
        ones=torch.ones(capacity, device=device),
        rows=torch.arange(capacity, device=device),
        word=torch.arange(vocab, device=device) // 32,
        # 1 << 31 wraps to int32's sign bit, which is that word's bit 31.
        bit=(1 << (torch.arange(vocab, device=device) % 32)).to(torch.int32),
    )


def masked(
    z: torch.Tensor, allow: torch.Tensor | None, tables: Tables, fresh: bool = True
) -> torch.Tensor:
    """`z` with the tokens a row's bitmask `allow` [B, vocab / 32] forbids pushed far below
    every allowed one (finite: the nucleus arithmetic subtracts scores; their
    probability is 0 all the same). None: no row of the step is constrained. `fresh`: `z`
    is the step's own tensor, written in place."""
    if allow is None:
        return z
    # An & with each token's bit (a shift by a tensor, or an & with a Python int, took
    # 30 times as long on CPU).
    forbidden = (allow.index_select(1, tables.word) & tables.bit) == 0
    return z.masked_fill_(forbidden, _FORBIDDEN) if fresh else z.masked_fill(forbidden, _FORBIDDEN)


def _finish(
    token: torch.Tensor,
    raw: torch.Tensor,
    top: torch.Tensor | None,
    offset: torch.Tensor,
    counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    cursor: torch.Tensor,
    tables: Tables,
    k_top: int,
) -> torch.Tensor:
    """The end of every variant: state updates after the draw, and the packed result,
    logprobs (`raw`) read at the chosen token and at the top-k ids `top`. `top` None:
    `plain_step`'s rows, whose penalty state is never read and whose top-k is not wanted
    (zeros packed in their place)."""
    if top is not None:
        # Penalties count the generated token: frequency each time, presence the first
        # time (both stored negated and divided by the temperature, like the offset).
        # index_put_ rather than scatter_add_: compiled, a scatter into an input is done on
        # a copy of the whole [B, vocab] state and copied back; index_put_ is in place.
        at = (tables.rows[: len(token)], token[:, 0])
        seen = counts[at]
        offset.index_put_(at, torch.addcmul(frequency, presence, seen == 0), accumulate=True)
        counts.index_put_(at, tables.ones[: len(token)], accumulate=True)
    cursor.add_(1)
    if top is None:
        none = raw.new_zeros(len(raw), k_top)
        return torch.cat([token.float(), none, raw.gather(1, token), none], 1)
    ids = torch.cat([token, top], 1)
    return torch.cat([ids.float(), raw.gather(1, ids)], 1)


def sample_step(
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
    tables: Tables,
    k_top: int,
    allow: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row; returns the packed [B, 2 + 2 k_top] float32 result: the
    token and the top-k ids, then their logprobs.

    Every per-row tensor has one row per row of `logits`. `offset` (penalties and bias) is
    stored divided by the temperature, so z = logits / T + offset in one op; `top_p` is
    inf for rows that keep the whole distribution; `counts`, `offset` and `cursor` are
    updated in place (they may be views of the sampler's state)."""
    # In float32 whatever the logits' dtype: the log-softmax casts as it reads, addcmul
    # promotes to the offset's float32.
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    top = logits.topk(k_top, dim=-1).indices
    z = masked(torch.addcmul(offset, logits, inv_t[:, None]), allow, tables)
    cand, cand_ids = z.topk(min(_CANDIDATES, z.shape[1]), dim=-1)
    # Probabilities are read through their logs: compiled, neither is written out (the
    # log-softmax's max and sum become one online pass on CUDA; the histogram below
    # exponentiates as it reads), eager they cost one exp.
    lp = torch.log_softmax(z, dim=-1)
    pc = lp.gather(1, cand_ids)
    pc = (pc if allow is None else pc.clamp_(min=_EXP_FLOOR)).exp_()
    cmass = pc.cumsum(dim=-1)
    target = top_p[:, None]
    # A narrow nucleus ends among the candidates: its last token is exact (ties stay).
    narrow = cmass[:, -1:] >= target
    # Kept: the candidates whose mass above them is below top_p, the first always; the
    # last of them is the first whose cumulative mass reaches top_p (the last candidate
    # when none does). Cumulative masses are sorted, so counts are binary searches.
    last = torch.searchsorted(cmass, target).clamp_(max=cand.shape[1] - 1)
    floor = cand.gather(1, last)
    # Mass per (vocabulary block, bin); bin d holds tokens d/_PER_NAT nats below `floor`
    # (bin 0: at or above it; the last bin: everything further down).
    depth = torch.sub(floor * _PER_NAT, z, alpha=_PER_NAT).ceil_().clamp_(0, _BINS - 1)
    table = z.new_zeros(z.shape[0], tables.block_ids.shape[0] * _BINS)
    mass = lp.exp() if allow is None else lp.clamp(min=_EXP_FLOOR).exp_()
    table.scatter_add_(1, (depth + tables.cells).long(), mass)
    table = table.view(z.shape[0], -1, _BINS)
    # Bins are kept while the mass above them is below top_p; a narrow nucleus is bin 0.
    # The edge: the last bin whose mass above it is below top_p (bin 0's is none).
    # (Searched among all but the catch-all last bin: past them, the edge is that bin.)
    bins = table.sum(dim=1)
    edge = torch.searchsorted(bins[:, :-1].cumsum(dim=-1), target).masked_fill_(narrow, 0)
    # The mass of bins 0..edge of each block: a running sum over the bins, read at edge.
    blocks = table.cumsum(dim=-1).gather(2, edge[:, :, None].expand(-1, table.shape[1], 1))
    blocks = blocks[:, :, 0]
    # Inverse CDF in vocabulary order: the block, then the token inside it.
    u = ring.gather(1, (cursor % ring.shape[1])[:, None])
    cdf = blocks.cumsum(dim=-1)
    goal = u * cdf[:, -1:]
    b = torch.searchsorted(cdf, goal, right=True)
    goal = goal - (cdf - blocks).gather(1, b)
    ids = tables.block_ids.index_select(0, b[:, 0])
    valid = tables.block_valid.index_select(0, b[:, 0])
    w = lp.gather(1, ids).exp_() * (depth.gather(1, ids) <= edge) * valid
    wc = w.cumsum(dim=-1)
    # Rounding (block sums against this cumsum) must not push the draw past the block.
    goal = torch.minimum(goal, wc[:, -1:] * _BELOW_ONE).clamp_(min=0.0)
    token = ids.gather(1, torch.searchsorted(wc, goal, right=True))
    token = torch.where(greedy[:, None], cand_ids[:, :1], token)
    return _finish(token, raw, top, offset, counts, presence, frequency, cursor, tables, k_top)


def greedy_step(
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
    tables: Tables,
    k_top: int,
    allow: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample_step` for a batch without sampled rows (the CPU shortcut): the argmax of the
    adjusted logits, same result and state updates."""
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    top = logits.topk(k_top, dim=-1).indices
    # max() rather than argmax(): the same first maximal index, faster on CPU.
    token = masked(offset + logits, allow, tables).max(dim=-1, keepdim=True).indices
    return _finish(token, raw, top, offset, counts, presence, frequency, cursor, tables, k_top)


def plain_step(
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
    tables: Tables,
    k_top: int,
    allow: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU shortcut for greedy rows without bias, penalties or logprobs: the argmax
    and its logprob (their counts and offsets are never read, so they stay)."""
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    token = masked(logits, allow, tables, fresh=False).max(dim=-1, keepdim=True).indices
    return _finish(token, raw, None, offset, counts, presence, frequency, cursor, tables, k_top)
