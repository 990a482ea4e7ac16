"""A fixed-shape sampler: per-row state lives on the device, one packed result per step.

Interface (slots are 0 .. capacity-1; by default logits row i is slot i):

    s = Sampler(capacity, vocab, device, max_logprobs=20, compile=False)
    s.admit(slots, params)        # RowParams per slot: parameters, logit_bias, seeded rng
    packed = s.step(logits)       # logits [B, vocab], B <= capacity: rows are slots 0..B-1
    packed = s.step(logits, rows) # or rows[i] = the slot of logits row i (admission steps)
    out = s.unpack(packed.cpu())  # StepOut: tokens, chosen logprobs, top-k ids/logprobs
    s.release(slots)              # finished rows: the slot turns greedy and plain
    s.move(src, dst)              # slot dst[i] takes slot src[i]'s state (compaction, swaps)

`shortcut` (default: on CPU only) runs every batch through one native call (native.py,
the graph's semantics a row at a time) where the CPU extension builds; without it (or with
`native=False`) a batch without sampled rows runs `greedy_step`, and one of plain greedy
rows (no bias, penalties or logprobs) `plain_step`.

Without the shortcut, `step` launches the same tensor ops whatever B and the parameter
mix (greedy, nucleus, penalties, bias, logprobs): no host synchronisation, no per-row Python, no
data-dependent shapes. It updates the state in place (generated-token counts, the
penalty offset, the uniform cursors) and returns ONE float32 device tensor
[B, 2 + 2k]: column 0 the token id, then k top ids (best first), then the logprobs of
those 1 + k ids (ids are exact in float32 below 2**24; k is 5, or max_logprobs in a step
with a row that wants more), so the host does one device-to-host copy per step. The
host side of a step is a few numpy operations; every _RING/2 steps or so it tops up the
uniform rings (one host-to-device copy). The core,
`sample_step` (sample_step.py, with the shortcuts), is a pure function of tensors that runs under
`torch.compile(fullgraph=True)` (tested on CPU); `Sampler(compile=True)` uses it
compiled. Eager is the default: compile time is paid per engine and per row count.

Semantics are BatchSampler's (the sampler before this one, now the tests' oracle:
tests/engine/oracle.py): logprobs from the raw logits; penalties and logit_bias, then
temperature; top_p; one uniform per step per sampled row from the row's own generator
(pre-drawn into a per-slot ring on the device), inverse CDF over the kept tokens in
vocabulary order. So a seeded row draws the same tokens whatever shares the
batch, and the same tokens as BatchSampler did (wide nuclei aside, below).
Temperatures below TEMPERATURE_EPSILON are greedy (1 / 1e-45 overflows float32).

How: penalties and bias live in one [capacity, vocab] offset kept divided by the row's
temperature, updated in place: the bias scattered from padded (id, value) rows at
admission, penalties at the chosen token after each step. The step reads [B, vocab] in:
the log-softmax of the raw logits (read only at the chosen and top-k ids) and the top-k of
the logits, z = logits / T + offset (one addcmul), top-C of z (the greedy token, and the
nucleus edge, exact, when the nucleus lies within the C most likely tokens: most rows),
the log-softmax of z, and one scatter pass summing probability per (vocabulary block,
log-probability bin below the edge). Bins give the edge of wider nuclei: tokens within
1/_PER_NAT nat of their last token stay, like ties. The draw picks a block from the block
sums and a token inside it (one block per row). State updates at the chosen token use
index_put_, which inductor does in place (a scatter_add_ into an input is done on a copy
of the whole [B, vocab] tensor, then copied back).

Compiled, that is four passes over [B, vocab] on CUDA: one kernel writes z and takes both
log-softmax reductions (max and sum in one online pass), two topk, and the histogram
(probabilities exponentiated as it reads z, nothing else written). `bench/sampler_passes.py`
counts them in inductor's generated code: six on the CPU backend, which has no online
softmax (each sum is a second loop), four on CUDA derived from those, not measured on a
GPU. Eager (CPU), the step is 59 aten ops whatever the batch. On CPU, batches without a
sampled row take `greedy_step` or `plain_step`: there every op costs its elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from batchwright.engine.platform.compiled import Compiled
from batchwright.engine.sampling.native import native_step
from batchwright.engine.sampling.params import TEMPERATURE_EPSILON, RowParams, StepOut
from batchwright.engine.sampling.sample_step import (
    _BELOW_ONE,
    _RING,
    greedy_step,
    make_tables,
    plain_step,
    sample_step,
)

# Top logprobs a step packs when no row wants more: /v1/completions' `logprobs` maximum.
_NARROW_TOP = 5


class Sampler:
    """Slot-indexed sampling state for up to `capacity` rows (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        vocab: int,
        device: torch.device,
        *,
        max_logprobs: int = 20,
        compile: bool = False,
        shortcut: bool | None = None,
        native: bool | None = None,
    ) -> None:
        if vocab >= 1 << 24:
            raise ValueError("token ids must be exact in float32 (vocab below 2**24)")
        self.capacity, self.vocab, self.device = capacity, vocab, device
        # Top logprobs packed per row: a step packs _NARROW_TOP (completions' most) unless
        # a row of the step wants more (chat's top_logprobs, up to max_logprobs).
        self.k_top = max(1, min(max_logprobs, vocab))
        self.k_narrow = min(self.k_top, _NARROW_TOP)
        self.tables = make_tables(vocab, capacity, device)

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
        self._plain = np.ones(capacity, dtype=bool)  # greedy, no bias, penalties, logprobs
        self._params: list[RowParams | None] = [None] * capacity
        self._k = np.zeros(capacity, dtype=np.int64)  # top logprobs each slot wants
        # Grammar-constrained slots (grammar.py) and their allowed tokens: one int32 bitmask
        # row per slot filled on the host, copied to the device for steps that have one.
        self._masked = np.zeros(capacity, dtype=bool)
        words = -(-vocab // 32)
        self.host_mask = torch.full((capacity, words), -1, dtype=torch.int32)
        if device.type == "cuda":
            self.host_mask = self.host_mask.pin_memory()
        self.mask = torch.full((capacity, words), -1, dtype=torch.int32, device=device)
        self._core: Callable[..., torch.Tensor] = sample_step
        self._greedy_core: Callable[..., torch.Tensor] = greedy_step
        self._plain_core: Callable[..., torch.Tensor] = plain_step
        if compile:
            opts = {"fullgraph": True, "dynamic": True}
            self._core = Compiled(sample_step, "sampler", **opts)
            self._greedy_core = Compiled(greedy_step, "sampler", **opts)
            self._plain_core = Compiled(plain_step, "sampler", **opts)
        # On CPU every op is a pass of its own and costs its elements: batches without a
        # sampled row skip the draw. On accelerators one graph serves every batch.
        self.shortcut = device.type == "cpu" if shortcut is None else shortcut
        # With the shortcut on CPU, every batch takes the native step (native.py) where the
        # CPU extension builds; `native=False` keeps the torch graphs.
        self._native: Callable[..., torch.Tensor] | None = None
        if self.shortcut and device.type == "cpu" and native is not False and not compile:
            self._native = native_step()

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
        # Penalties are kept negated and divided by the temperature, like the offset.
        self.presence[idx] = -floats[:, 2] * floats[:, 0]
        self.frequency[idx] = -floats[:, 3] * floats[:, 0]
        self.greedy[idx] = self._to_device(torch.tensor(greedy))
        # The offset is kept divided by the temperature (see sample_step).
        bias_vals = bias_vals * floats[:, :1]
        self.offset[idx] = torch.zeros_like(self.offset[idx]).scatter_add_(1, bias_ids, bias_vals)
        self.counts[idx] = 0
        self.cursor[idx] = 0
        for slot, p, g in zip(slots, params, greedy, strict=True):
            self._sampled[slot] = not g
            self._plain[slot] = g and not (p.logit_bias or p.penalised or p.logprobs is not None)
            self._params[slot] = p if not g else None
            self._k[slot] = p.logprobs or 0
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
            self._plain[slot] = True
            self._params[slot] = None
        self._k[list(slots)] = 0
        self.constrain(slots, False)

    def constrain(self, slots: Sequence[int], on: bool = True) -> None:
        """Slots whose tokens a grammar picks (their `host_mask` rows filled by the caller
        before each step), or no longer: every token allowed again."""
        idx = list(slots)
        self._masked[idx] = on
        if not on:
            self.host_mask[idx] = -1

    def masked(self, n: int) -> bool:
        """Whether the step over slots 0..n-1 applies the bitmask."""
        return bool(self._masked[:n].any())

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
        for a in (self._ring, self._drawn, self._used, self._sampled, self._plain, self._k):
            a[di] = a[si]
        self._masked[di] = self._masked[si]
        self.host_mask[list(dst)] = self.host_mask[list(src)]
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
            self.prepare(n)
            packed = self.core(logits)
            self.commit(n)
            return packed
        self._ensure_uniforms(list(rows))
        idx = self._index(rows)
        state = [t.index_select(0, idx) for t in self._tensors()]
        allow = None
        if self._masked[list(rows)].any():
            allow = self._to_device(self.host_mask[list(rows)])
        k = self._width(list(rows))
        packed = self._pick(list(rows))(logits, *state, self.tables, k, allow)
        for t, new in zip(self._tensors(), state, strict=True):
            t[idx] = new
        self._used[list(rows)] += 1
        return packed

    # The step over slots 0..n-1 in three parts, so the device part can be captured as a
    # graph (graphs.py): host work before it, the tensor work, host bookkeeping after.

    def prepare(self, n: int) -> None:
        """Before the step: uniforms on the device for every sampled row that draws, and
        the bitmask rows when a row is constrained (one copy, not waited for)."""
        self._ensure_uniforms(slice(0, n))
        if self.masked(n):
            self.mask[:n].copy_(self.host_mask[:n], non_blocking=True)

    def core(self, logits: torch.Tensor) -> torch.Tensor:
        """The tensor work for rows 0..len(logits)-1: no host reads or writes (without the
        shortcut, the same ops whatever the rows hold; with or without the bitmask, and
        the packed width, as `masked(n)` and `width(n)` say: a captured step records each
        combination apart)."""
        n = logits.shape[0]
        state = [t[:n] for t in self._tensors()]
        allow = self.mask[:n] if self.masked(n) else None
        k = self._width(slice(0, n))
        return self._pick(slice(0, n))(logits, *state, self.tables, k, allow)

    def width(self, n: int) -> int:
        """Top logprobs the step over slots 0..n-1 packs."""
        return self._width(slice(0, n))

    def _width(self, rows: slice | list[int]) -> int:
        wanted = self._k[rows]
        return self.k_top if len(wanted) and wanted.max() > self.k_narrow else self.k_narrow

    def commit(self, n: int) -> None:
        """After the step: each row consumed one uniform."""
        self._used[:n] += 1

    def unpack(self, packed: torch.Tensor) -> StepOut:
        """The host's view of a packed step (call it on the copy: `packed.cpu()`)."""
        k = (packed.shape[1] - 2) // 2
        values: list[list[float]] = packed.tolist()
        return StepOut(
            tokens=[int(r[0]) for r in values],
            chosen_logprobs=[r[1 + k] for r in values],
            top_ids=[[int(t) for t in r[1 : 1 + k]] for r in values],
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

    def _pick(self, rows: slice | list[int]) -> Callable[..., torch.Tensor]:
        if self._native is not None and self.shortcut:
            return self._native
        if not self.shortcut or self._sampled[rows].any():
            return self._core
        return self._plain_core if self._plain[rows].all() else self._greedy_core

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
