"""A fixed-shape sampler: per-row state lives on the device, one packed result per step.

Interface (what a scheduler calls; slots are 0 .. capacity-1, logits row i is slot i):

    s = Sampler(capacity, vocab, device, max_logprobs=5)
    s.admit(slots, params)        # RowParams per slot: parameters, logit_bias, seeded rng
    packed = s.step(logits)       # logits [B, vocab], B <= capacity: rows are slots 0..B-1
    packed = s.step(logits, rows) # or rows[i] = the slot of logits row i (admission steps)
    out = s.unpack(packed.cpu())  # StepOut: tokens, chosen logprobs, top-k ids/logprobs
    s.release(slots)              # finished rows: the slot turns greedy and plain
    s.move(src, dst)              # slot dst takes slot src's whole state (compaction, swaps)

`step` launches a fixed sequence of tensor ops whatever B and the parameter mix (greedy,
nucleus, penalties, bias, logprobs), has no host synchronisation and no per-row Python,
and updates the state in place (generated-token counts, penalties, uniform cursors). It
returns ONE float32 device tensor [B, 2 + 2 * max_logprobs] — column 0 the token id,
1 its logprob, then max_logprobs top ids and their logprobs, best first (ids are exact in
float32 below 2**24) — so the host does one device-to-host copy per step. The core,
`sample_step`, is a pure function of tensors that runs under
`torch.compile(fullgraph=True)`; `Sampler(compile=True)` uses it compiled (eager by
default: on CPU compiling costs more than it saves at small vocabularies).

Semantics are BatchSampler's (sampling.py): logprobs from the raw logits; penalties and
logit_bias, then temperature; top_p; one uniform per step per sampled row from the row's
own generator, inverse CDF over the kept tokens in vocabulary order. Temperatures below
TEMPERATURE_EPSILON are greedy (1 / 1e-45 overflows float32).

Passes over [B, vocab] (each a kernel under torch.compile, where the elementwise work fuses
into them): log-sum-exp of the raw logits (with the penalty/bias offset added and
temperature applied on the way), top-k of the raw logits (logprobs), top-C of the
adjusted logits (the greedy token, the maximum, the nucleus when it lies within the C most
likely tokens), and one scatter pass that sums probability mass per (vocabulary block,
log-probability bin). The draw then reads one block. Nuclei wider than C tokens end in
the bin of their boundary: tokens within 1/_PER_NAT nat of the last token kept stay, like
ties. Penalties and bias live in one [capacity, vocab] offset updated in place: bias
scattered from padded (id, value) rows at admission, penalties at the chosen token of
each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from batchwright.engine.sampling import RowParams, StepOut

TEMPERATURE_EPSILON = 1e-5
# Candidates read off the adjusted logits (the nucleus of most rows fits in them).
_CANDIDATES = 64
# Log-probability bins below the C-th candidate, _PER_NAT per nat; the last is a catch-all.
_BINS = 64
_PER_NAT = 8
# Uniforms held per slot on the device; a slot's ring is topped up every _RING/2 steps.
_RING = 64


def _blocks(vocab: int) -> tuple[int, int]:
    """Vocabulary block size and count: the (block, bin) table stays about vocab / 8."""
    n = max(1, min(vocab // (8 * _BINS), 256))
    size = -(-vocab // n)
    return size, -(-vocab // size)


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
    k_top: int,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. Every tensor but `logits` has one row per row of `logits`;
    `counts`/`offset`/`cursor` are updated in place (they may be views of the state).
    Returns (packed [B, 2 + 2 k_top] float32, tokens [B] long)."""
    x = logits.float()
    rows, vocab = x.shape
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    top_vals, top_ids = x.topk(k_top, dim=-1)
    # Penalties and bias, then temperature (in place on the adjusted copy).
    z = x + offset
    z.mul_(inv_t[:, None])
    cand, cand_ids = z.topk(min(_CANDIDATES, vocab), dim=-1)
    zmax = cand[:, :1]
    pc = torch.exp(cand - zmax)
    cmass = pc.cumsum(dim=-1)
    # Mass of every token, per (block, bin); bins count nats below the C-th candidate.
    p = torch.exp(z - zmax)
    depth = ((cand[:, -1:] - z) * _PER_NAT).ceil_().clamp_(0, _BINS - 1)
    ids = torch.arange(vocab, device=x.device)
    cell = (ids // block * _BINS)[None, :] + depth.long()
    nblocks = -(-vocab // block)
    table = p.new_zeros(rows, nblocks * _BINS).scatter_add_(1, cell, p)
    table = table.view(rows, nblocks, _BINS)
    total = table.sum(dim=(1, 2))[:, None]
    target = top_p[:, None] * total
    # Narrow nucleus: the C candidates reach top_p; keep the smallest prefix that does.
    narrow = (cmass[:, -1:] >= target) & (top_p[:, None] < 1.0)
    kept_c = ((cmass - pc) < target) | (torch.arange(cand.shape[1], device=x.device) == 0)
    u = ring.gather(1, cursor[:, None] % ring.shape[1])
    tok_narrow = _draw_candidates(pc * kept_c, cand_ids, u, vocab)
    # Everything else: bins kept while the mass before them is below top_p (all at 1).
    bins = table.sum(dim=1)
    before = bins.cumsum(dim=-1) - bins
    edge = ((before < target) | (top_p[:, None] >= 1.0)).sum(dim=-1, keepdim=True) - 1
    keep_bin = torch.arange(_BINS, device=x.device)[None, :] <= edge
    blocks = (table * keep_bin[:, None, :]).sum(dim=-1)
    tok_wide = _draw_blocks(z, zmax, blocks, edge, cand[:, -1:], u, block)
    token = torch.where(narrow, tok_narrow, tok_wide)
    token = torch.where(greedy[:, None], cand_ids[:, :1], token)
    chosen = x.gather(1, token) - lse
    # Penalties count the generated token: frequency each time, presence the first time.
    seen = counts.gather(1, token)
    pen = frequency[:, None] + presence[:, None] * (seen == 0)
    offset.scatter_add_(1, token, -pen)
    counts.scatter_add_(1, token, torch.ones_like(seen))
    cursor.add_(1)
    packed = torch.cat([token.float(), chosen, top_ids.float(), top_vals - lse], dim=1)
    return packed, token[:, 0]


def _draw_candidates(
    w: torch.Tensor, ids: torch.Tensor, u: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Inverse CDF over the weighted candidates, taken in vocabulary order."""
    order = torch.where(w > 0, ids, vocab).argsort(dim=-1)
    w = w.gather(1, order)
    cdf = w.cumsum(dim=-1)
    k = (cdf <= u * cdf[:, -1:]).sum(dim=-1, keepdim=True)
    last = (w > 0).sum(dim=-1, keepdim=True) - 1
    return ids.gather(1, order.gather(1, torch.minimum(k, last)))


def _draw_blocks(
    z: torch.Tensor,
    zmax: torch.Tensor,
    blocks: torch.Tensor,
    edge: torch.Tensor,
    floor: torch.Tensor,
    u: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Inverse CDF in vocabulary order: pick the block, then the token inside it."""
    vocab = z.shape[1]
    cdf = blocks.cumsum(dim=-1)
    goal = u * cdf[:, -1:]
    nonzero = torch.arange(blocks.shape[1], device=z.device) * (blocks > 0)
    b = torch.minimum((cdf <= goal).sum(dim=-1, keepdim=True), nonzero.amax(-1, keepdim=True))
    goal = goal - (cdf.gather(1, b) - blocks.gather(1, b))
    ids = b * block + torch.arange(block, device=z.device)[None, :]
    valid = ids < vocab
    zb = z.gather(1, ids.clamp(max=vocab - 1))
    depth = ((floor - zb) * _PER_NAT).ceil().clamp(0, _BINS - 1)
    w = torch.exp(zb - zmax) * ((depth <= edge) & valid)
    wc = w.cumsum(dim=-1)
    pos = torch.arange(block, device=z.device)[None, :]
    k = torch.minimum((wc <= goal).sum(dim=-1, keepdim=True), (pos * (w > 0)).amax(-1, True))
    return ids.gather(1, k)


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
        self.block, _ = _blocks(vocab)

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
        self._core: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sample_step
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
                    p.top_p,
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
        """Slot dst[i] takes slot src[i]'s state (a source may also be a destination)."""
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

    # --- the step ------------------------------------------------------------------------

    def step(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Sample one token per row of `logits`; the packed [B, 2 + 2k] result stays on the
        device. Row i is slot i, or slot rows[i] when `rows` is given."""
        if rows is None:
            n = logits.shape[0]
            self._ensure_uniforms(slice(0, n))
            state = [t[:n] for t in self._tensors()]
            packed, _ = self._core(logits, *state, self.k_top, self.block)
            self._used[:n] += 1
            return packed
        self._ensure_uniforms(list(rows))
        idx = self._index(rows)
        state = [t.index_select(0, idx) for t in self._tensors()]
        packed, _ = self._core(logits, *state, self.k_top, self.block)
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
            self._drawn[s] += need
        self.ring[self._index(slots)] = self._to_device(torch.from_numpy(self._ring[slots]))
