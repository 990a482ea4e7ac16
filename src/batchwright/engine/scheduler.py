"""Continuous batching: one decode loop over the model's forward with a paged KV cache.

Each iteration admits waiting candidates into free slots and runs one forward that carries
the decode step of every slot and the prompts being admitted (attention.py); rows that
finish leave at once and release their blocks, and new rows take their slots. Requests
are read from the caller's iterable a bounded window ahead (longest generation first),
and admitted while slots and KV blocks last.

What a steady decode step needs lives on the device and is updated in place when rows
join or leave (slots.py, sampler.py): next tokens, lengths, block tables, sampling
parameters and token counts. The step
reads back one packed tensor (tokens, logprobs, top-k) and nothing else; the host then
records tokens, matches stops and builds results. Models that cannot take the
variable-length attention go through padded.py, on the same paged cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import nullcontext
from typing import Any

import torch

from batchwright.engine import prefix
from batchwright.engine.admission import Placement, cached_prompts, place
from batchwright.engine.attention import Step, decode_runs, fixed_runs
from batchwright.engine.backends import VarlenArgs
from batchwright.engine.compiled import compile_on
from batchwright.engine.device import ReadBack, on
from batchwright.engine.grammar import RowGrammars
from batchwright.engine.graphs import DecodeGraphs, capture_for, graphs_on
from batchwright.engine.intake import Intake, Unit
from batchwright.engine.jobs import Seq
from batchwright.engine.lora.run import LoraRun, segments_of
from batchwright.engine.online import Lane, OnlineFeed
from batchwright.engine.padded import padded_decode, padded_prefill
from batchwright.engine.parts import Parts
from batchwright.engine.sampler import Sampler
from batchwright.engine.sampling import StepOut
from batchwright.engine.slots import Slots
from batchwright.engine.types import GenRequest, GenResult

Cancelled = Callable[[], AbstractSet[Any]]

# Reference attention: on CPU, runs minimise tokens gathered plus this many per call
# (about one SDPA call's cost); elsewhere runs of fixed size (each call is a launch).
_CALL_COST = 120
_MAX_RUN = 16
_GPU_RUN = 64


class Scheduler:
    def __init__(self, engine: Parts) -> None:
        self.e = engine
        self.device = engine.lm.device
        self.vocab = engine.lm.vocab_size
        self.context_length = engine.lm.context_length
        self.backend = engine.attention_backend
        self.invariant_rows = engine.lm.invariant_rows if self.backend == "native" else None
        captured = graphs_on(engine.spec, self.device, self.backend)
        fixed_rows = self.device.type == "cuda" or captured
        self.slots = Slots(engine.new_cache(), engine.max_rows, fixed=fixed_rows)
        self.cache = self.slots.cache
        # Sampler slots 0..max_rows-1 are the batch slots; the rest take the candidates
        # being admitted until their first token is drawn. A captured step runs the one
        # fixed sampling graph; on CUDA it is compiled, graphs or not (compiled.py).
        fixed: dict[str, bool] = {"shortcut": False} if captured else {}
        compiled = compile_on(engine.spec, self.device, self.backend)
        # Compiled code guards on how its inputs were made: the step's tensors must all be
        # ordinary ones, as the long-lived state is, where inference mode would make the
        # ones built in a step different (and every step a recompile). Eager, inference
        # mode skips the autograd bookkeeping that no_grad keeps.
        self._no_grad = torch.no_grad if compiled else torch.inference_mode
        self.sampler = Sampler(
            2 * engine.max_rows, self.vocab, self.device, compile=compiled, **fixed
        )
        self.graphs = DecodeGraphs(self, capture_for(self.device)) if captured else None
        self.grammar = RowGrammars(self.sampler)
        self.prefix = prefix.enabled(engine.spec, engine.lm.varlen, self.cache)
        # On CUDA the host works one step behind: it records step t's tokens while step
        # t + 1 runs (rows that finished run one extra step, dropped). On CPU nothing runs
        # while the host works, so the extra step would only cost.
        self.lag = self.device.type == "cuda" and engine.lm.varlen
        self._pending: Outputs | None = None
        # LoRA adapters (engine/lora/): rows of any adapters share each forward.
        self.lora = LoraRun(engine.lora, self.slots.seqs) if engine.lora is not None else None
        self.adapters_on = False  # the forward running adds adapter deltas (graphs.py keys)

    def run(
        self,
        requests: Iterable[GenRequest],
        cancelled: Cancelled | None = None,
        online: OnlineFeed | None = None,
    ) -> Iterator[GenResult]:
        intake = Intake(self.e, requests)
        # Online requests go first, taking batch rows when none are free (online.py).
        lane = self.lane = Lane(self, intake, online)
        try:
            while True:
                if cancelled is not None:
                    self._cancel(intake, cancelled())
                s = self.slots
                if self.lora is not None:
                    self.lora.new_round()
                units = yield from lane.admit()
                kv_cost, prompt_cost = prefix.admission_costs(self.prefix, self.kv_cost)
                batch = yield from intake.admit(
                    lane.batch_rows(bool(units)),
                    packed=self.e.lm.varlen,
                    kv_free=self.cache.alloc.free,
                    kv_cost=kv_cost,
                    prompt_cost=prompt_cost,
                    running=self._running,
                    # An online request waiting for its grammar keeps the loop from
                    # waiting on the batch source (the lane waits for the grammar).
                    idle=not s.live and not lane.waiting,
                    gate=self.lora.gate if self.lora is not None else None,
                )
                lane.started(batch)
                units += batch
                if not units and not intake.pending and s.compactable():
                    # Rows move only when no step's tokens are still to be recorded: the
                    # host waits for the step in flight only when rows will move.
                    yield from self._emit(self._drain())
                    self._compact()
                if not units and not s.live and intake.pending and not lane.waiting:
                    cache = self.cache
                    yield intake.reject_head((cache.alloc.num_blocks - 1) * cache.block_size)
                    continue
                if units or s.live:
                    with on(self.device), self._no_grad():
                        done = self._step(units)
                    yield from self._emit(done)
                else:
                    yield from self._emit(self._drain())
                idle = not units and not s.live and self._pending is None
                if idle and intake.drained and not lane.waiting:
                    return
        finally:
            self.slots.release_all()
            # The lane points back at the scheduler: left in place, the cycle keeps this
            # run's KV pools and sampler state resident until a full collection, so the
            # next run (a worker's next file) allocates its own on top of them.
            del self.lane

    def _running(self) -> Counter[Hashable]:
        return Counter(q.job.group for q in self.slots.seqs if q is not None)

    def kv_cost(self, unit: Unit) -> int:
        return self.cache.blocks_needed(len(unit.prompt), _max_new(unit), len(unit.seqs))

    def _cancel(self, intake: Intake, keys: AbstractSet[Any]) -> None:
        """Drop the rows and the waiting candidates of requests in `keys`; no results."""
        if not keys:
            return
        intake.drop(keys)
        self.lane.drop(keys)
        gone = [i for i, s in enumerate(self.slots.seqs) if s is not None and s.job.key in keys]
        if gone:
            self.slots.finish(gone)
            self.sampler.release(gone)

    def _emit(self, done: list[GenResult]) -> list[GenResult]:
        """The step's deltas of streamed requests go out before its results."""
        self.lane.emit()
        return done

    def _compact(self) -> None:
        moved = self.slots.compact()
        if moved:
            self.sampler.move(*moved)

    def _step(self, units: list[Unit]) -> list[GenResult]:
        """One forward for the decode step of every slot and the prefill of `units`."""
        s = self.slots
        n = s.rows_for_step()
        placed = place(self.cache, s, units, self.prefix)
        if self.lora is None or not self.e.lm.varlen:
            return self._forward(n, placed)
        decode = self.lora.decode_index(n)
        prompts = [(self.lora.slot_of(p.unit.job), p.length - p.cached) for p in placed]
        segments = segments_of(decode, prompts)
        if self.invariant_rows:  # the padding tokens _forward appends run without adapters
            pad = -sum(length for _, length in segments) % self.invariant_rows
            segments += [(0, pad)] if pad else []
        with self.lora.step(segments) as self.adapters_on:
            return self._forward(n, placed)

    def _forward(self, n: int, placed: list[Placement]) -> list[GenResult]:
        s = self.slots
        if not placed and n and self.graphs is not None:
            early = self._constrained_drain(n)
            return early + self._outputs(n, self.graphs.step(n, self._max_k(n)))
        if not self.e.lm.varlen:
            return self._padded_step(n, placed)
        ids, positions, dest = (
            [s.tokens[:n]],
            [s.lens[:n]],
            [self.cache.decode_dest(s.lens[:n])],
        )
        bounds: list[tuple[int, int]] = []
        if placed:
            start = 0
            for p in placed:
                # Only the tokens after a cached prefix are computed (prefix.py).
                bounds.append((start, start + p.length - p.cached))
                start += p.length - p.cached
            ids.append(s.host_long([t for p in placed for t in p.unit.prompt[p.cached :]]))
            positions.append(s.host_long([i for p in placed for i in range(p.cached, p.length)]))
            dest.append(s.host_long([d for p in placed for d in p.dest]))
        # Batch-invariant steps (invariance.py): every prompt token through the paged
        # kernel, as a decode row reads, and the tokens padded to the GEMM's row multiple.
        multiple = self.invariant_rows
        fresh = [b for b, p in zip(bounds, placed, strict=True) if not p.cached and not multiple]
        tokens = n + (bounds[-1][1] if bounds else 0)
        pad = -tokens % multiple if multiple else 0
        if pad:
            ids.append(s.host_long([0] * pad))
            positions.append(s.host_long([0] * pad))
            dest.append(s.host_long([0] * pad))
        plan = Step(
            self.cache, n, torch.cat(dest) if len(dest) > 1 else dest[0], fresh, self.backend
        )
        plan.pad, plan.tiles = pad, not multiple
        self._plan_attention(plan, n, placed)
        if self.backend != "varlen":
            plan.cached = cached_prompts(
                self.cache, n, placed, bounds, self.backend, every=bool(multiple)
            )
        keep: torch.Tensor | None = None
        kept = n + len(bounds)
        if placed:
            rows = [*range(n), *(n + e - 1 for _, e in bounds)]
            if multiple:
                rows += [rows[-1]] * (-len(rows) % multiple)
            keep = s.host_long(rows)
        logits = self.e.forward_step(
            torch.cat(ids) if len(ids) > 1 else ids[0],
            torch.cat(positions) if len(positions) > 1 else positions[0],
            keep,
            plan,
        )[:kept]
        done = self._advance(n, logits[:n]) if n else []
        if placed:
            done += self._admit(placed, logits[n:])
        return done

    def _plan_attention(self, plan: Step, n: int, placed: Sequence[Placement]) -> None:
        s = self.slots
        if self.backend == "native":
            plan.lens = torch.where(s.alive[:n], s.lens[:n] + 1, 0)
        elif self.backend == "reference":
            lengths = [
                x + 1 if q is not None else 1 for x, q in zip(s.hlen[:n], s.seqs[:n], strict=True)
            ]
            live = [q is not None for q in s.seqs[:n]]
            if self.device.type == "cpu":
                plan.runs = decode_runs(lengths, live, _CALL_COST, _MAX_RUN)
            else:
                plan.runs = fixed_runs(lengths, _GPU_RUN) if n else []
            plan.run_lens = lengths
        else:
            plan.varlen = self._varlen_args(n, placed, self._max_k(n))

    def decode_plan(self, n: int, max_k: int) -> Step:
        """A varlen step of decode rows only, the longest reading at most `max_k` keys
        (what graphs.py records)."""
        s = self.slots
        dest = self.cache.decode_dest(s.lens[:n])
        plan = Step(self.cache, n, dest, [], "varlen")
        plan.varlen = self._varlen_args(n, [], max_k)
        return plan

    def decode_body(self, n: int, max_k: int) -> torch.Tensor:
        """The device work of a steady decode step, from long-lived tensors only (what
        graphs.py records): the forward, the sampler's fixed graph, the advance."""
        s = self.slots
        logits = self.e.forward_step(s.tokens[:n], s.lens[:n], None, self.decode_plan(n, max_k))
        packed = self.sampler.core(logits)
        s.advance(n, packed[:, 0])
        return packed

    def _varlen_args(self, n: int, placed: Sequence[Placement], max_k: int) -> VarlenArgs:
        """Decode rows (one query, dead rows read one scratch token) then prompts."""
        s = self.slots
        # A dead row (length 0) reads its one scratch token.
        seqused = (s.lens[:n] + 1).int()
        table = self.cache.table[:n]
        cu_q = s.arange_int[: n + 1]
        max_q = 1
        if placed:
            lengths = [p.length for p in placed]
            new = [p.length - p.cached for p in placed]  # queries after a cached prefix
            seqused = torch.cat([seqused, s.host_int(lengths)])
            table = torch.cat([table, self.cache.host_rows([p.slot for p in placed])])
            starts = [n]
            for x in new:
                starts.append(starts[-1] + x)
            cu_q = torch.cat([cu_q[:n], s.host_int(starts)])
            max_q, max_k = max(max_q, *new), max(max_k, *lengths)
        cu_k = torch.nn.functional.pad(seqused.cumsum(0, dtype=torch.int32), (1, 0))
        return VarlenArgs(cu_q, cu_k, seqused, table, max_q, max_k)

    def _max_k(self, n: int) -> int:
        """Keys the longest decode row reads (hlen trails by a step when the host works
        one behind: an upper bound is enough)."""
        return max(self.slots.hlen[:n], default=0) + 1 + int(self.lag)

    def _padded_step(self, n: int, placed: Sequence[Placement]) -> list[GenResult]:
        s = self.slots
        done = []
        lora = self.lora
        if n:
            with (
                nullcontext() if lora is None else lora.step(segments_of(lora.decode_index(n), []))
            ):
                logits = padded_decode(self.e.forward_last, self.cache, s, n)
            done = self._advance(n, logits)
        if placed:
            # Prompts run left-padded to the longest: each row's tokens are its adapter's.
            width = max(p.length for p in placed)
            rows = [] if lora is None else [(lora.slot_of(p.unit.job), width) for p in placed]
            with nullcontext() if lora is None else lora.step(rows):
                logits = padded_prefill(self.e.forward_last, self.cache, placed)
            done += self._admit(placed, logits)
        return done

    def _advance(self, n: int, logits: torch.Tensor) -> list[GenResult]:
        """Sample every slot's next token. With `lag` the host records the previous
        step's tokens now, while this one runs, and this one's at the next step."""
        early = self._constrained_drain(n)
        packed = self.sampler.step(logits)
        self.slots.advance(n, packed[:, 0])
        return early + self._outputs(n, packed)

    def _constrained_drain(self, n: int) -> list[GenResult]:
        """A grammar's mask for this step follows the previous step's tokens: with the host
        a step behind, they are recorded (and the masks filled) before this step samples,
        while its forward runs."""
        return self._drain() if self.lag and self.sampler.masked(n) else []

    def _outputs(self, n: int, packed: torch.Tensor) -> list[GenResult]:
        # The step's one read-back, started without waiting on CUDA.
        step = Outputs(packed, self.slots.seqs[:n])
        if not self.lag:
            return self._record(step)
        done = self._drain()
        self._pending = step
        return done

    def _drain(self) -> list[GenResult]:
        step, self._pending = self._pending, None
        return self._record(step) if step is not None else []

    def _record(self, step: Outputs) -> list[GenResult]:
        """Record a step's tokens for the rows that still hold their slots; rows that
        finish leave at once (with lag they ran one more step, whose token is dropped)."""
        s = self.slots
        out = self.sampler.unpack(step.host())
        seqs = [
            q if q is not None and q.finish is None and s.seqs[i] is q else None
            for i, q in enumerate(step.seqs)
        ]
        for i, q in enumerate(seqs):
            if q is not None:
                s.hlen[i] += 1
        done, keep = self._push(seqs, out)
        self.grammar.next((i, seqs[i]) for i in keep)
        kept = set(keep)
        finished = [i for i, q in enumerate(seqs) if q is not None and i not in kept]
        if finished:
            s.finish(finished)
            self.sampler.release(finished)
        return done

    def _admit(self, placed: Sequence[Placement], logits: torch.Tensor) -> list[GenResult]:
        """First token of every candidate of the prompts just prefilled; the candidates
        still running keep their slots (the first the prefilled blocks, the others share
        the full prompt blocks), the rest release theirs."""
        s = self.slots
        index = [i for i, p in enumerate(placed) for _ in p.unit.seqs]
        seqs = [q for p in placed for q in p.unit.seqs]
        if len(seqs) != len(placed):
            logits = logits.index_select(0, s.host_long(index))
        scratch = [s.max_rows + i for i in range(len(seqs))]
        self.sampler.admit(scratch, [q.params for q in seqs])
        self.grammar.start(scratch, seqs)
        packed = self.sampler.step(logits, rows=scratch)
        out = self.sampler.unpack(packed.cpu())
        done, keep = self._push(seqs, out)
        self.grammar.next((scratch[j], seqs[j]) for j in keep)
        kept = set(keep)
        rows: list[int] = []
        slots: list[int] = []
        j = 0
        for p in placed:
            running = [c for c in range(len(p.unit.seqs)) if j + c in kept]
            got = s.settle(p.slots, p.length, p.total, [seqs[j + c] for c in running])
            rows += [j + c for c in running]
            slots += got
            j += len(p.unit.seqs)
        if rows:
            s.start(slots, packed[:, 0].long(), rows)
            self.sampler.move([scratch[r] for r in rows], slots)
        self.sampler.release(scratch)
        return done

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


class Outputs:
    """A step's packed outputs on their way to the host, and the rows they belong to."""

    def __init__(self, packed: torch.Tensor, seqs: list[Seq | None]) -> None:
        self.seqs = seqs
        self.packed = ReadBack(packed, packed.device)

    def host(self) -> torch.Tensor:
        return self.packed.wait()


def _max_new(unit: Unit) -> int:
    """The most tokens a candidate of `unit` may generate (and cache)."""
    job = unit.job
    return min(job.req.max_tokens, job.context_length - len(unit.prompt))
