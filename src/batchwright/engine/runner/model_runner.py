"""The model runner: the device state of a loaded model, and one step on it.

Built once per loaded model (and rebuilt only when its rows or attention backend change):
the batch slots and their device state (slots.py), the KV manager with the paged pools and
the prefix index (kv/), the sampler's per-slot state (sampling/), the captured decode
graphs (graphs.py) and the grammar matchers' rows. So the first step of a run costs what a
steady one does, and a prefix cached in one run is found in the next.

A step takes the units the scheduler planned: it places them (slots, blocks), runs one
forward carrying every row's decode token and the new prompts (attention.py's plan, or the
padded path for models without batchwright's attention), samples every row, and hands the
sampled tokens to the recorder (the output processor), which says which rows go on. On
CUDA the host works one step behind: it records step t's tokens while step t + 1 runs
(rows that finished run one extra step, dropped). On CPU nothing runs while the host
works, so the extra step would only cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from batchwright.engine.attention.interface import Step
from batchwright.engine.kv import prefix
from batchwright.engine.kv.manager import KVManager, Placement
from batchwright.engine.loading.loader import LoadedModel
from batchwright.engine.lora.run import LoraRun, segments_of
from batchwright.engine.platform.compiled import compile_on
from batchwright.engine.platform.device import ReadBack, on
from batchwright.engine.requests.jobs import Job, Seq, Unit
from batchwright.engine.runner.cache import new_cache
from batchwright.engine.runner.forward import Forward
from batchwright.engine.runner.graphs import DecodeGraphs, capture_for, graphs_on
from batchwright.engine.runner.padded import padded_decode, padded_prefill
from batchwright.engine.runner.slots import Slots
from batchwright.engine.runner.step_inputs import cached_prompts, plan_attention, varlen_args
from batchwright.engine.sampling.grammar import RowGrammars
from batchwright.engine.sampling.params import StepOut
from batchwright.engine.sampling.sampler import Sampler
from batchwright.registry import ModelSpec


class Recorder(Protocol):
    """What the runner hands a step's tokens to (output/processor.py)."""

    def record(self, seqs: Sequence[Seq | None], out: StepOut) -> list[int]:
        """Record one token per live row (None: no row); returns the rows still running."""
        ...


class ModelRunner:
    def __init__(
        self, lm: LoadedModel, spec: ModelSpec, forward: Forward, max_rows: int, backend: str
    ) -> None:
        self.lm = lm
        self.forward = forward
        self.max_rows = max_rows
        self.backend = backend
        self.device = device = lm.device
        self.context_length = lm.context_length
        self.invariant_rows = lm.invariant_rows if backend == "native" else None
        captured = graphs_on(spec, device, backend)
        self.slots = Slots(
            new_cache(lm, spec, max_rows), max_rows, fixed=device.type == "cuda" or captured
        )
        self.cache = self.slots.cache
        self.kv = KVManager(
            self.cache,
            prefix.enabled(spec, lm.varlen, self.cache),
            context_length=lm.context_length,
        )
        # Sampler slots 0..max_rows-1 are the batch slots; the rest take the candidates
        # being admitted until their first token is drawn. A captured step runs the one
        # fixed sampling graph; on CUDA it is compiled, graphs or not (compiled.py).
        fixed: dict[str, bool] = {"shortcut": False} if captured else {}
        compiled = compile_on(spec, device, backend)
        # Compiled code guards on how its inputs were made: the step's tensors must all be
        # ordinary ones, as the long-lived state is, where inference mode would make the
        # ones built in a step different (and every step a recompile). Eager, inference
        # mode skips the autograd bookkeeping that no_grad keeps.
        self._no_grad = torch.no_grad if compiled else torch.inference_mode
        self.sampler = Sampler(2 * max_rows, lm.vocab_size, device, compile=compiled, **fixed)
        self.graphs = DecodeGraphs(self, capture_for(device)) if captured else None
        self.grammar = RowGrammars(self.sampler)
        # LoRA adapters (engine/lora/): rows of any adapters share each forward.
        self.lora = LoraRun(forward.lora, self.slots.seqs) if forward.lora is not None else None
        self.adapters_on = False  # the forward running adds adapter deltas (graphs.py keys)
        self.lag = device.type == "cuda" and lm.varlen
        self._pending: Outputs | None = None
        self.out: Recorder | None = None  # the run's output processor (`begin`)

    # --- what the scheduler reads (scheduling/rows.py) --------------------------------------

    @property
    def seqs(self) -> list[Seq | None]:
        return self.slots.seqs

    @property
    def free(self) -> int:
        return self.slots.free_count

    @property
    def live(self) -> int:
        return self.slots.live

    def compactable(self) -> bool:
        return self.slots.compactable()

    def end(self, rows: list[int]) -> None:
        if rows:
            self.slots.finish(rows)
            self.sampler.release(rows)

    @property
    def idle(self) -> bool:
        """No row runs and no step's tokens wait to be recorded."""
        return not self.slots.live and self._pending is None

    def lane_rows(self) -> int:
        """Rows the lane's requests (online requests) hold."""
        return sum(1 for q in self.slots.seqs if q is not None and q.job.online)

    # --- a run -----------------------------------------------------------------------------

    def begin(self, out: Recorder) -> None:
        self.out = out

    def reset(self) -> None:
        """The run is over: every row ends (a run that stopped early leaves some), and a
        step whose tokens were not recorded is dropped. Blocks go back; the prefix
        index keeps what it cached."""
        self._pending = None
        self.end([i for i, q in enumerate(self.slots.seqs) if q is not None])
        self.out = None

    def cancel(self, keys: AbstractSet[Any]) -> None:
        """Rows of the requests in `keys` leave at once."""
        gone = [i for i, s in enumerate(self.slots.seqs) if s is not None and s.job.key in keys]
        self.end(gone)

    def compact(self) -> None:
        moved = self.slots.compact()
        if moved:
            self.sampler.move(*moved)

    def drain(self) -> None:
        """Record the step in flight (host one step behind), if any."""
        step, self._pending = self._pending, None
        if step is not None:
            self._record(step)

    # --- echo scores ----------------------------------------------------------------------

    def score(self, job: Job) -> None:
        """The echo scores of `job`'s prompts (echo with logprobs), asked for by the
        scheduler as it takes the request: a forward of each prompt alone, beside the rows
        and the paged cache (forward.py's score_prompt), under the job's adapter."""
        k = job.req.logprobs or 0
        job.prompt_scores = {
            i: self.forward.score_prompt(p, k, job.adapter) for i, p in enumerate(job.prompts)
        }

    # --- a step ----------------------------------------------------------------------------

    def step(self, units: list[Unit]) -> None:
        """One forward for the decode step of every slot and the prefill of `units`."""
        with on(self.device), self._no_grad():
            self._step(units)

    def _step(self, units: list[Unit]) -> None:
        s = self.slots
        n = s.rows_for_step()
        placed = self.kv.place(units, s.take)
        lora = self.lora
        if lora is None or not self.lm.varlen:
            self._forward(n, placed)
            return
        prompts = [(lora.slot_of(p.unit.job), p.length - p.cached) for p in placed]
        segments = segments_of(lora.decode_index(n), prompts)
        if self.invariant_rows:  # the padding tokens _forward appends run without adapters
            pad = -sum(length for _, length in segments) % self.invariant_rows
            segments += [(0, pad)] if pad else []
        with lora.step(segments) as self.adapters_on:
            self._forward(n, placed)

    def _forward(self, n: int, placed: list[Placement]) -> None:
        s = self.slots
        if not placed and n and self.graphs is not None:
            self._constrained_drain(n)
            self._outputs(n, self.graphs.step(n, self._max_k(n)))
            return
        if not self.lm.varlen:
            self._padded_step(n, placed)
            return
        ids, positions, dest = [s.tokens[:n]], [s.lens[:n]], [self.cache.decode_dest(s.lens[:n])]
        bounds: list[tuple[int, int]] = []
        if placed:
            start = 0
            for p in placed:
                # Only the tokens after a cached prefix are computed (kv/prefix.py).
                bounds.append((start, start + p.length - p.cached))
                start += p.length - p.cached
            ids.append(s.host_long([t for p in placed for t in p.unit.prompt[p.cached :]]))
            positions.append(s.host_long([i for p in placed for i in range(p.cached, p.length)]))
            dest.append(s.host_long([d for p in placed for d in p.dest]))
        # Batch-invariant steps (loading/invariance.py): every prompt token through the paged
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
        plan.pad = pad
        plan_attention(plan, s, n, placed, self._max_k(n))
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
        logits = self.forward.step(
            torch.cat(ids) if len(ids) > 1 else ids[0],
            torch.cat(positions) if len(positions) > 1 else positions[0],
            keep,
            plan,
        )[:kept]
        if n:
            self._advance(n, logits[:n])
        if placed:
            self._admit(placed, logits[n:])

    def decode_plan(self, n: int, max_k: int) -> Step:
        """A varlen step of decode rows only, the longest reading at most `max_k` keys
        (what graphs.py records)."""
        dest = self.cache.decode_dest(self.slots.lens[:n])
        plan = Step(self.cache, n, dest, [], "varlen")
        plan.varlen = varlen_args(self.slots, n, [], max_k)
        return plan

    def decode_body(self, n: int, max_k: int) -> torch.Tensor:
        """The device work of a steady decode step, from long-lived tensors only (what
        graphs.py records): the forward, the sampler's fixed graph, the advance."""
        s = self.slots
        logits = self.forward.step(s.tokens[:n], s.lens[:n], None, self.decode_plan(n, max_k))
        packed = self.sampler.core(logits)
        s.advance(n, packed[:, 0])
        return packed

    def _max_k(self, n: int) -> int:
        """Keys the longest decode row reads (hlen trails by a step when the host works
        one behind: an upper bound is enough)."""
        return max(self.slots.hlen[:n], default=0) + 1 + int(self.lag)

    def _padded_step(self, n: int, placed: Sequence[Placement]) -> None:
        s = self.slots
        lora = self.lora
        if n:
            with (
                nullcontext() if lora is None else lora.step(segments_of(lora.decode_index(n), []))
            ):
                logits = padded_decode(self.forward.last, self.cache, s, n)
            self._advance(n, logits)
        if placed:
            # Prompts run left-padded to the longest: each row's tokens are its adapter's.
            width = max(p.length for p in placed)
            rows = [] if lora is None else [(lora.slot_of(p.unit.job), width) for p in placed]
            with nullcontext() if lora is None else lora.step(rows):
                logits = padded_prefill(self.forward.last, self.cache, placed)
            self._admit(placed, logits)

    def _advance(self, n: int, logits: torch.Tensor) -> None:
        """Sample every slot's next token. With `lag` the host records the previous
        step's tokens now, while this one runs, and this one's at the next step."""
        self._constrained_drain(n)
        packed = self.sampler.step(logits)
        self.slots.advance(n, packed[:, 0])
        self._outputs(n, packed)

    def _constrained_drain(self, n: int) -> None:
        """A grammar's mask for this step follows the previous step's tokens: with the host
        a step behind, they are recorded (and the masks filled) before this step samples,
        while its forward runs."""
        if self.lag and self.sampler.masked(n):
            self.drain()

    def _outputs(self, n: int, packed: torch.Tensor) -> None:
        # The step's one read-back, started without waiting on CUDA.
        step = Outputs(packed, self.slots.seqs[:n])
        if not self.lag:
            self._record(step)
            return
        self.drain()
        self._pending = step

    def _record(self, step: Outputs) -> None:
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
        assert self.out is not None
        keep = self.out.record(seqs, out)
        self.grammar.next((i, seqs[i]) for i in keep)
        kept = set(keep)
        finished = [i for i, q in enumerate(seqs) if q is not None and i not in kept]
        if finished:
            s.finish(finished)
            self.sampler.release(finished)

    def _admit(self, placed: Sequence[Placement], logits: torch.Tensor) -> None:
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
        assert self.out is not None
        keep = self.out.record(seqs, out)
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


class Outputs:
    """A step's packed outputs on their way to the host, and the rows they belong to."""

    def __init__(self, packed: torch.Tensor, seqs: list[Seq | None]) -> None:
        self.seqs = seqs
        self.packed = ReadBack(packed, packed.device)

    def host(self) -> torch.Tensor:
        return self.packed.wait()
