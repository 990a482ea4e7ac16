"""Continuous batching: one decode loop over the model's forward with a shared KV cache.

Each iteration admits waiting candidates into free rows and runs one forward that carries
both the decode step of every row and the prompts being admitted (see attention.py);
rows that finish leave, and new rows take their slots. Requests are read from the
caller's iterable a bounded window ahead (longest generation admitted first). Models that
cannot take the variable-length attention run a left-padded prefill and a separate
decode step instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from batchwright.engine.attention import (
    Step,
    best_partner,
    decode_runs,
    fixed_runs,
    run_masks,
)
from batchwright.engine.intake import Intake, Unit
from batchwright.engine.jobs import Seq
from batchwright.engine.kvcache import BatchCache, empty_batch, new_cache
from batchwright.engine.sampler import Sampler
from batchwright.engine.sampling import StepOut
from batchwright.engine.types import GenRequest, GenResult

if TYPE_CHECKING:
    from batchwright.engine.runtime import Engine


# Decode attention runs (see attention.py). On CPU the rows are split to minimise columns
# read plus the cost of a call (about as much as reading this many columns, measured),
# in runs of at most _MAX_RUN rows. Elsewhere every call is a kernel launch: fixed runs.
_CALL_COST = {"cpu": 120}
_MAX_RUN = 16
# Rows per group when a new row looks for neighbours of similar length.
_GROUP_ROWS = {"cpu": 8}
_GROUP_ROWS_DEFAULT = 64


class Scheduler:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        dev = engine.lm.device
        self.device = dev
        self.vocab = engine.lm.vocab_size
        self.batch = empty_batch(dev)
        self.seqs: list[Seq | None] = []  # per slot; None = dead slot awaiting reuse
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(0, dtype=torch.long, device=dev)  # cached tokens per row
        # Slots 0..max_rows-1 mirror the batch rows; the rest take candidates being admitted.
        self.sampler = Sampler(2 * engine.max_rows, self.vocab, dev)
        self.alive = torch.zeros(0, dtype=torch.bool, device=dev)
        self.varlen = engine.lm.varlen
        self.group_rows = _GROUP_ROWS.get(dev.type, _GROUP_ROWS_DEFAULT)
        self.call_cost = _CALL_COST.get(dev.type)
        # The native kernel reads each row's own columns: no runs, masks or regrouping.
        self.native = engine.lm.native_attention and self.varlen

    @property
    def live(self) -> int:
        return sum(1 for s in self.seqs if s is not None)

    def run(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        intake = Intake(self.e, requests)
        while True:
            free = self.e.max_rows - self.live
            units = yield from intake.admit(free, packed=self.varlen)
            if self.varlen:
                if units or self.live:
                    yield from self._step(units)
            elif units:
                yield from self._prefill(units)
            self._maybe_compact(waiting=bool(intake.pending))
            if not self.varlen and self.live:
                yield from self._decode()
            if not units and not self.live and intake.drained:
                return

    @torch.inference_mode()
    def _maybe_compact(self, *, waiting: bool) -> None:
        """Drop dead slots nobody is waiting for, and long all-padding column prefixes."""
        if not self.seqs:
            return
        dead = len(self.seqs) - self.live
        drop_rows = dead > 0 and not waiting and 4 * dead >= len(self.seqs)
        prefix = self.batch.dead_prefix()
        if self.varlen:
            # Neither the native kernel nor the SDPA runs read those columns, so they only
            # cost memory: drop them when the cache must grow anyway (one copy, not two).
            drop_cols = prefix >= 64 and self.batch.headroom() == 0
        else:
            drop_cols = prefix >= max(64, self.batch.columns // 4)
        if drop_rows or drop_cols:
            self._take([i for i, s in enumerate(self.seqs) if s is not None or not drop_rows])

    def _take(self, keep: list[int]) -> None:
        """Keep the slots `keep`, in that order (the cache is copied once)."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.batch.compact(rows)
        self.seqs = [self.seqs[i] for i in keep]
        self.next_tokens = self.next_tokens.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self.sampler.move(keep, range(len(keep)))
        self._resample()

    def _attention_lengths(self) -> list[int]:
        """Columns each row attends to in the next decode step (1 for a dead slot)."""
        lens: list[int] = torch.where(self.alive, self.lengths + 1, 1).tolist()
        return lens

    def _decode_runs(self) -> tuple[list[tuple[int, int, int]], list[torch.Tensor | None]]:
        """Runs of rows and their masks for SDPA decode attention (no native kernel)."""
        lengths = self._attention_lengths()
        if self.call_cost is None:
            runs = fixed_runs(lengths, self.group_rows)
        else:
            live: list[bool] = self.alive.tolist()
            runs = decode_runs(lengths, live, self.call_cost, _MAX_RUN)
        return runs, run_masks(runs, lengths, self.e.lm.dtype, self.device)

    def _resample(self) -> None:
        self.alive = torch.tensor(
            [s is not None for s in self.seqs], dtype=torch.bool, device=self.device
        )

    @torch.inference_mode()
    def _step(self, units: list[Unit]) -> list[GenResult]:
        """One forward for the decode step of every row and the prefill of `units`."""
        dev = self.device
        rows = len(self.seqs) if self.live else 0
        prompts = [u.prompt for u in units]
        bounds, start = [], 0
        for p in prompts:
            bounds.append((start, start + len(p)))
            start += len(p)
        ids = [self.next_tokens[:rows]]
        positions = [torch.where(self.alive, self.lengths, 0)[:rows]]
        if prompts:
            ids.append(torch.tensor([t for p in prompts for t in p], device=dev))
            positions.append(torch.cat([torch.arange(len(p), device=dev) for p in prompts]))
        keep = [*range(rows), *(rows + e - 1 for _, e in bounds)]
        runs: list[tuple[int, int, int]] = []
        masks: list[torch.Tensor | None] = []
        lens = None
        if rows:
            self.batch.append_column()
            if self.native:
                lens = torch.where(self.alive, self.lengths + 1, 0)
            else:
                runs, masks = self._decode_runs()
        plan = Step(rows, self.batch.cache, runs, masks, bounds, lens=lens)
        logits = self.e.forward_step(
            torch.cat(ids), torch.cat(positions), torch.tensor(keep, device=dev), plan
        )
        done = self._advance(logits[:rows]) if rows else []
        if units:
            packed = [plan.captured[i] for i in range(len(plan.captured))]
            done += self._admit(units, logits[rows:], BatchCache.unpack(packed, bounds))
        return done

    @torch.inference_mode()
    def _prefill(self, units: list[Unit]) -> list[GenResult]:
        """Prefill `units` as one left-padded batch (models without varlen attention)."""
        width = max(len(u.prompt) for u in units)
        ids = torch.zeros((len(units), width), dtype=torch.long)
        mask = torch.zeros((len(units), width), dtype=torch.long)
        for i, u in enumerate(units):
            n = len(u.prompt)
            ids[i, width - n :] = torch.tensor(u.prompt)
            mask[i, width - n :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = new_cache()
        logits = self.e.forward_last(ids, mask, positions, cache)
        return self._admit(units, logits, BatchCache(cache, mask))

    @torch.inference_mode()
    def _decode(self) -> list[GenResult]:
        """One decode step over the padded batch (models without varlen attention)."""
        # Dead slots run too (cheaper than reshaping the batch every step). Their new column
        # is unmasked so no attention row is fully masked (SDPA would produce NaNs there).
        mask = self.batch.append_column()
        positions = torch.where(self.alive, self.lengths, 0)[:, None]
        logits = self.e.forward_last(self.next_tokens[:, None], mask, positions, self.batch.cache)
        return self._advance(logits)

    def _advance(self, logits: torch.Tensor) -> list[GenResult]:
        """Sample every row's next token from `logits`; rows that finish become dead slots."""
        self.lengths = self.lengths + 1
        packed = self.sampler.step(logits)
        out = self.sampler.unpack(packed.cpu())
        self.next_tokens = packed[:, 0].long()
        done, keep = self._push(self.seqs, out)
        kept = set(keep)
        finished = [i for i, s in enumerate(self.seqs) if s is not None and i not in kept]
        if finished:
            for i in finished:
                self.seqs[i] = None
            self.batch.kill(finished)
            self.sampler.release(finished)
            self._resample()
        return done

    def _admit(self, units: list[Unit], logits: torch.Tensor, part: BatchCache) -> list[GenResult]:
        """First token of each candidate of `units` (prefilled into `part`, one row per unit);
        the candidates still running take dead slots first, then new slots."""
        dev = self.device
        index = torch.tensor([i for i, u in enumerate(units) for _ in u.seqs], device=dev)
        seqs = [s for u in units for s in u.seqs]
        if len(seqs) != len(units):
            part = part.expand(index)
            logits = logits.index_select(0, index)
        scratch = [self.e.max_rows + i for i in range(len(seqs))]
        self.sampler.admit(scratch, [s.params for s in seqs])
        out = self.sampler.unpack(self.sampler.step(logits, rows=scratch).cpu())
        done, keep = self._push(seqs, out)
        if not keep:
            self.sampler.release(scratch)
            return done
        rows = torch.tensor(keep, device=dev)
        if len(keep) != len(seqs):
            part.select(rows)
        new_tokens = torch.tensor([out.tokens[i] for i in keep], device=dev)
        lens = torch.tensor([len(seqs[i].prompt) for i in keep], device=dev)
        # Dead slots are written in place; the rest become new slots.
        dead = [i for i, s in enumerate(self.seqs) if s is None][: len(keep)]
        slots = [*dead, *range(len(self.seqs), len(self.seqs) + len(keep) - len(dead))]
        self.sampler.move([scratch[i] for i in keep], slots)
        self.sampler.release(scratch)
        if dead:
            n = len(dead)
            head = BatchCache(part.cache, part.mask)
            if n < len(keep):
                head = part.expand(torch.arange(n, device=dev))
            self.batch.fill(dead, head)
            at = torch.tensor(dead, device=dev)
            self.next_tokens[at] = new_tokens[:n]
            self.lengths[at] = lens[:n]
            for slot, i in zip(dead, keep[:n], strict=True):
                self.seqs[slot] = seqs[i]
            if self.varlen and not self.native:
                self._regroup(dead)
        if len(keep) > len(dead):
            n = len(dead)
            tail = part if n == 0 else part.expand(torch.arange(n, len(keep), device=dev))
            self.batch.merge(tail)
            self.seqs.extend(seqs[i] for i in keep[n:])
            self.next_tokens = torch.cat([self.next_tokens, new_tokens[n:]])
            self.lengths = torch.cat([self.lengths, lens[n:]])
        self._resample()
        return done

    def _regroup(self, rows: list[int]) -> None:
        """Keep rows of similar length next to each other, as an attention run costs the
        width of its longest row: each new row in `rows` may swap places with a row of
        another group of neighbours when that narrows the two groups. Only the two rows'
        tokens and sampler state are swapped."""
        alive = zip(self.lengths.tolist(), self.seqs, strict=True)
        lens = [n if s is not None else 0 for n, s in alive]
        for x in rows:
            y = best_partner(lens, x, self.group_rows)
            if y < 0:
                continue
            self.batch.swap(x, y, max(lens[x], lens[y]))
            self.seqs[x], self.seqs[y] = self.seqs[y], self.seqs[x]
            lens[x], lens[y] = lens[y], lens[x]
            pair = torch.tensor([x, y], device=self.device)
            swapped = torch.tensor([y, x], device=self.device)
            for t in (self.next_tokens, self.lengths):
                t[pair] = t[swapped]
            self.sampler.move([x, y], [y, x])

    def _push(self, seqs: Sequence[Seq | None], out: StepOut) -> tuple[list[GenResult], list[int]]:
        """Record one token per live row; results of jobs now complete, rows still running."""
        done: list[GenResult] = []
        keep: list[int] = []
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
            top = None
            k = seq.params.logprobs
            if k is not None and out.top_ids is not None and out.top_logprobs is not None:
                top = list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True))
            elif k is not None:
                top = []
            if seq.push(out.tokens[i], out.chosen_logprobs[i], top):
                if seq.job.done:
                    done.append(self.e.result(seq.job))
            else:
                keep.append(i)
        return done, keep
