"""A fixed-shape sampler: per-row state lives on the device, one packed result per step.

Interface (slots are 0 .. capacity-1; by default logits row i is slot i):

    s = Sampler(capacity, vocab, device, max_logprobs=5, compile=False)
    s.admit(slots, params)        # RowParams per slot: parameters, logit_bias, seeded rng
    packed = s.step(logits)       # logits [B, vocab], B <= capacity: rows are slots 0..B-1
    packed = s.step(logits, rows) # or rows[i] = the slot of logits row i (admission steps)
    out = s.unpack(packed.cpu())  # StepOut: tokens, chosen logprobs, top-k ids/logprobs
    s.release(slots)              # finished rows: the slot turns greedy and plain
    s.move(src, dst)              # slot dst[i] takes slot src[i]'s state (compaction, swaps)

`step` launches the same tensor ops whatever B and the parameter mix (greedy, nucleus,
penalties, bias, logprobs): no host synchronisation, no per-row Python, no
data-dependent shapes. It updates the state in place (generated-token counts, the
penalty offset, the uniform cursors) and returns ONE float32 device tensor
[B, 2 + 2 * max_logprobs]: column 0 the token id, 1 its logprob, then max_logprobs top
ids and their logprobs, best first (ids are exact in float32 below 2**24), so the host
does one device-to-host copy per step. The host side of a step is a few numpy operations;
every _RING/2 steps or so it tops up the uniform rings (one host-to-device copy). The core,
`sample_step`, is a pure function of tensors that runs under
`torch.compile(fullgraph=True)`; `Sampler(compile=True)` uses it compiled (eager by
default: on CPU compiling costs more than it saves at small vocabularies).

Semantics are BatchSampler's (sampling.py): logprobs from the raw logits; penalties and
logit_bias, then temperature; top_p; one uniform per step per sampled row from the row's
own generator (pre-drawn into a per-slot ring on the device), inverse CDF over the kept
tokens in vocabulary order. So a seeded row draws the same tokens whatever shares the
batch, and the same tokens as BatchSampler did. Temperatures below TEMPERATURE_EPSILON
are greedy (1 / 1e-45 overflows float32).

How: penalties and bias live in one [capacity, vocab] offset, updated in place: the bias
scattered from padded (id, value) rows at admission, penalties at the chosen token after
each step. The step reads [B, vocab] in: log-sum-exp of the raw logits, top-k of the raw
logits (logprobs), the adjusted logits z (offset added, temperature applied in place) with
their log-sum-exp, top-C of z (the greedy token, and the nucleus edge, exact, when the
nucleus lies within the C most likely tokens: most rows), and one scatter pass summing
probability mass per (vocabulary block, log-probability bin below the edge). Bins give
the edge of wider nuclei: tokens within 1/_PER_NAT nat of their last token stay, like
ties. The draw picks a block from the block sums and a token inside it. Under
torch.compile the elementwise work fuses into those reductions (four passes: raw
log-sum-exp with z and its log-sum-exp, two top-k, the scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from batchwright.engine.sampling import TEMPERATURE_EPSILON, RowParams, StepOut

# Candidates read off the adjusted logits (the nucleus of most rows fits in them).
_CANDIDATES = 64
# Log-probability bins below the C-th candidate, _PER_NAT per nat; the last is a catch-all.
_BINS = 64
_PER_NAT = 8
# Uniforms held per slot on the device; a slot's ring is topped up every _RING/2 steps.
_RING = 64
# Uniforms are kept below 1 by this much so u * total stays below total in float32.
_BELOW_ONE = 1.0 - 2.0**-23


class Tables(NamedTuple):
    """Constant index tables of one vocabulary (built once per Sampler)."""

    cells: torch.Tensor  # [vocab] long: first cell of each token's block in the table
    block_ids: torch.Tensor  # [blocks, block] long: token ids per block (padded with vocab-1)
    block_valid: torch.Tensor  # [blocks, block] float: 1 for real ids, 0 for padding
    bins: torch.Tensor  # [1, _BINS] long: 0 .. _BINS-1


def make_tables(vocab: int, device: torch.device) -> Tables:
    # Blocks are sized so the (block, bin) table is about vocab / 8 cells per row.
    n = max(1, min(vocab // (8 * _BINS), 256))
    size = -(-vocab // n)
    blocks = -(-vocab // size)
    ids = torch.arange(blocks * size, device=device).view(blocks, size)
    return Tables(
        cells=torch.arange(vocab, device=device) // size * _BINS,
        block_ids=ids.clamp(max=vocab - 1),
        block_valid=(ids < vocab).float(),
        bins=torch.arange(_BINS, device=device)[None, :],
    )


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
) -> torch.Tensor:
    """One token per row; returns the packed [B, 2 + 2 k_top] float32 result.

    Every per-row tensor has one row per row of `logits`; `top_p` is inf for rows that
    keep the whole distribution; `counts`, `offset` and `cursor` are updated in place (they
    may be views of the sampler's state)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    top_vals, top_ids = x.topk(k_top, dim=-1)
    # Penalties and bias, then temperature (in place on the adjusted copy).
    z = x + offset
    z.mul_(inv_t[:, None])
    cand, cand_ids = z.topk(min(_CANDIDATES, z.shape[1]), dim=-1)
    zmax = cand[:, :1]
    # Unnormalised probabilities are exp(z - zmax); their sum is exp(lse(z) - zmax).
    target = top_p[:, None] * torch.exp(torch.logsumexp(z, dim=-1, keepdim=True) - zmax)
    pc = torch.exp(cand - zmax)
    cmass = pc.cumsum(dim=-1)
    # A narrow nucleus ends among the candidates: its last token is exact (ties stay).
    narrow = cmass[:, -1:] >= target
    kept = ((cmass - pc) < target).sum(dim=-1, keepdim=True).clamp_(min=1)
    floor = torch.where(narrow, cand.gather(1, kept - 1), cand[:, -1:])
    # Mass per (vocabulary block, bin); bin d holds tokens d/_PER_NAT nats below `floor`
    # (bin 0: at or above it; the last bin: everything further down).
    p = torch.exp(z - zmax)
    depth = ((floor - z) * _PER_NAT).ceil_().clamp_(0, _BINS - 1)
    table = p.new_zeros(p.shape[0], tables.block_ids.shape[0] * _BINS)
    table.scatter_add_(1, tables.cells + depth.long(), p)
    table = table.view(p.shape[0], -1, _BINS)
    # Bins are kept while the mass above them is below top_p; a narrow nucleus is bin 0.
    bins = table.sum(dim=1)
    above = bins.cumsum(dim=-1) - bins
    edge = torch.where(narrow, 0, (above < target).sum(dim=-1, keepdim=True) - 1)
    blocks = (table * (tables.bins <= edge)[:, None, :]).sum(dim=-1)
    # Inverse CDF in vocabulary order: the block, then the token inside it.
    u = ring.gather(1, (cursor % ring.shape[1])[:, None])
    cdf = blocks.cumsum(dim=-1)
    goal = u * cdf[:, -1:]
    b = (cdf <= goal).sum(dim=-1)
    goal = goal - (cdf - blocks).gather(1, b[:, None])
    ids = tables.block_ids.index_select(0, b)
    w = p.gather(1, ids) * (depth.gather(1, ids) <= edge) * tables.block_valid.index_select(0, b)
    wc = w.cumsum(dim=-1)
    # Rounding (block sums against this cumsum) must not push the draw past the block.
    goal = torch.minimum(goal, wc[:, -1:] * _BELOW_ONE).clamp_(min=0.0)
    token = ids.gather(1, (wc <= goal).sum(dim=-1, keepdim=True))
    token = torch.where(greedy[:, None], cand_ids[:, :1], token)
    chosen = x.gather(1, token) - lse
    # Penalties count the generated token: frequency each time, presence the first time.
    seen = counts.gather(1, token)
    offset.scatter_add_(1, token, -(frequency[:, None] + presence[:, None] * (seen == 0)))
    counts.scatter_add_(1, token, torch.ones_like(seen))
    cursor.add_(1)
    return torch.cat([token.float(), chosen, top_ids.float(), top_vals - lse], dim=1)


class Sampler:
    """Slot-indexed sampling state for up to `capacity` rows (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        vocab: int,
        device: torch.device,
        *,
        max_logprobs: int = 5,
        compile: bool = False,
    ) -> None:
        if vocab >= 1 << 24:
            raise ValueError("token ids must be exact in float32 (vocab below 2**24)")
        self.capacity, self.vocab, self.device = capacity, vocab, device
        self.k_top = max(1, min(max_logprobs, vocab))
        self.tables = make_tables(vocab, device)

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.offset = zeros(capacity, vocab)
        self.counts = zeros(capacity, vocab)
        self.inv_t = torch.ones(capacity, device=device)
        self.greedy = torch.ones(capacity, dtype=torch.bool, device=device)
        self.top_p = torch.ones(capacity, device=device)
        self.presence = zeros(capacity)
        self.frequency = zeros(capacity)
        self.ring = zeros(capacity, _RING)
        self.cursor = zeros(capacity, dtype=torch.long)
        # Host mirror of the uniform rings: values drawn and consumed per slot.
        self._ring = np.zeros((capacity, _RING), dtype=np.float32)
        self._drawn = np.zeros(capacity, dtype=np.int64)
        self._used = np.zeros(capacity, dtype=np.int64)
        self._sampled = np.zeros(capacity, dtype=bool)
        self._params: list[RowParams | None] = [None] * capacity
        self._core: Callable[..., torch.Tensor] = sample_step
        if compile:
            self._core = torch.compile(sample_step, fullgraph=True)

    # --- slot state ----------------------------------------------------------------------

    def admit(self, slots: Sequence[int], params: Sequence[RowParams]) -> None:
        """Rows start in `slots` with `params`: counts cleared, bias scattered, uniforms
        drawn from each row's own generator."""
        if not slots:
            return
        idx = self._index(slots)
        width = max(1, max(len(p.logit_bias) for p in params))
        bias_ids = torch.zeros((len(slots), width), dtype=torch.long)
        bias_vals = torch.zeros((len(slots), width))
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_ids[i, : len(p.logit_bias)] = torch.tensor(list(p.logit_bias))
                bias_vals[i, : len(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()))
        greedy = [p.temperature < TEMPERATURE_EPSILON for p in params]
        floats = torch.tensor(
            [
                [
                    1.0 if g else 1.0 / p.temperature,
                    p.top_p if p.top_p < 1.0 else math.inf,
                    p.presence_penalty,
                    p.frequency_penalty,
                ]
                for p, g in zip(params, greedy, strict=True)
            ]
        )
        floats, bias_ids, bias_vals = (self._to_device(t) for t in (floats, bias_ids, bias_vals))
        self.inv_t[idx], self.top_p[idx] = floats[:, 0], floats[:, 1]
        self.presence[idx], self.frequency[idx] = floats[:, 2], floats[:, 3]
        self.greedy[idx] = self._to_device(torch.tensor(greedy))
        self.offset[idx] = torch.zeros_like(self.offset[idx]).scatter_add_(1, bias_ids, bias_vals)
        self.counts[idx] = 0
        self.cursor[idx] = 0
        for slot, p, g in zip(slots, params, greedy, strict=True):
            self._sampled[slot] = not g
            self._params[slot] = p if not g else None
            self._drawn[slot] = self._used[slot] = 0
        self._top_up([s for s, g in zip(slots, greedy, strict=True) if not g])

    def release(self, slots: Sequence[int]) -> None:
        """Finished rows: their slots become greedy, unpenalised and draw nothing."""
        if not slots:
            return
        idx = self._index(slots)
        self.greedy[idx] = True
        self.presence[idx] = 0.0
        self.frequency[idx] = 0.0
        for slot in slots:
            self._sampled[slot] = False
            self._params[slot] = None

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Slot dst[i] takes slot src[i]'s state (a source may also be a destination);
        sources that are not destinations are released (a row's generator must have one
        slot only, or a second slot's refills would consume its uniforms)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for t in self._tensors():
            t[d] = t[s]
        si, di = np.asarray(src), np.asarray(dst)
        for a in (self._ring, self._drawn, self._used, self._sampled):
            a[di] = a[si]
        rngs = [self._params[i] for i in src]
        for i, r in zip(dst, rngs, strict=True):
            self._params[i] = r
        self.release(sorted(set(src) - set(dst)))

    # --- the step ------------------------------------------------------------------------

    def step(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Sample one token per row of `logits`; the packed [B, 2 + 2k] result stays on the
        device. Row i is slot i, or slot rows[i] when `rows` is given."""
        if rows is None:
            n = logits.shape[0]
            self._ensure_uniforms(slice(0, n))
            state = [t[:n] for t in self._tensors()]
            packed = self._core(logits, *state, self.tables, self.k_top)
            self._used[:n] += 1
            return packed
        self._ensure_uniforms(list(rows))
        idx = self._index(rows)
        state = [t.index_select(0, idx) for t in self._tensors()]
        packed = self._core(logits, *state, self.tables, self.k_top)
        for t, new in zip(self._tensors(), state, strict=True):
            t[idx] = new
        self._used[list(rows)] += 1
        return packed

    def unpack(self, packed: torch.Tensor) -> StepOut:
        """The host's view of a packed step (call it on the copy: `packed.cpu()`)."""
        k = self.k_top
        values: list[list[float]] = packed.tolist()
        return StepOut(
            tokens=[int(r[0]) for r in values],
            chosen_logprobs=[r[1] for r in values],
            top_ids=[[int(t) for t in r[2 : 2 + k]] for r in values],
            top_logprobs=[r[2 + k :] for r in values],
        )

    # --- helpers -------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        """Per-slot tensors in `sample_step`'s argument order."""
        return [
            self.offset,
            self.counts,
            self.inv_t,
            self.greedy,
            self.top_p,
            self.presence,
            self.frequency,
            self.ring,
            self.cursor,
        ]

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return self._to_device(torch.tensor(list(slots), dtype=torch.long))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _ensure_uniforms(self, rows: slice | list[int]) -> None:
        """Before a step: when a sampled row in `rows` has no uniform left, top up every
        sampled slot that is half empty (so refills come in batches, every ~_RING/2 steps)."""
        left = self._drawn[rows] - self._used[rows]
        if not (self._sampled[rows] & (left <= 0)).any():
            return
        low = np.nonzero(self._sampled & (self._drawn - self._used <= _RING // 2))[0]
        self._top_up(low.tolist())

    def _top_up(self, slots: list[int]) -> None:
        """Fill the free places of each slot's ring with the row's next uniforms."""
        if not slots:
            return
        for s in slots:
            params = self._params[s]
            assert params is not None
            need = _RING - int(self._drawn[s] - self._used[s])
            at = (self._drawn[s] + np.arange(need)) % _RING
            self._ring[s, at] = [params.rng.random() for _ in range(need)]
            np.minimum(self._ring[s], _BELOW_ONE, out=self._ring[s])
            self._drawn[s] += need
        self.ring[self._index(slots)] = self._to_device(torch.from_numpy(self._ring[slots]))
