"""Adapters in the engine (`Lora`, as long as the model) and in a scheduler run
(`LoraRun`: admission gate, each step's token index).

A job names its adapter (`Job.adapter`); `Lora.prepare` starts reading its weights
(store.py) and the intake admits the job once they are read (`job.lora`, a Future) and
its adapter has a slot (`LoraRun.gate`): a row never fails for want of a slot, it waits
until the rows pinning the slots end. Before each forward the scheduler hands `step` the
adapter slot of every token's row: the layers then add the deltas (kernels.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from batchwright.engine.lora.kernels import Dense, Grouped, Single, dense_state
from batchwright.engine.lora.layers import Wrapped, wrap
from batchwright.engine.lora.slots import LoraSlots
from batchwright.engine.lora.store import AdapterStore
from batchwright.engine.lora.weights import AdapterWeights


class Job(Protocol):
    """What this package reads of a job (engine/requests/jobs.py; not imported: the scheduler's
    modules import this package)."""

    adapter: str | None
    lora: Any  # Future[AdapterWeights] | None
    adapter_key: Any


class Seq(Protocol):
    @property
    def job(self) -> Job: ...


class Unit(Protocol):
    @property
    def job(self) -> Job: ...


class Lora:
    """A model's adapters: wrapped layers, device slots, the store of weights."""

    def __init__(
        self,
        model: Any,
        name: str,
        *,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        dense: bool,
        max_tokens: int,
    ) -> None:
        self.wrapped: Wrapped = wrap(model)
        self.state = self.wrapped.state
        self.device = device
        self.dtype = dtype
        self.dense = dense
        self.max_tokens = max_tokens
        self.slots = LoraSlots(self.wrapped.layers, max_loras, max_rank, device, dtype)
        self.slots.dense = dense
        self.store = AdapterStore(name, self.wrapped.shapes(), max_rank)

    def weights(self, job: Job) -> AdapterWeights | None:
        future = job.lora
        if future is None or not future.done() or future.exception() is not None:
            return None
        w: AdapterWeights = future.result()
        return w

    @contextmanager
    def scoring(self, adapter: str | None) -> Iterator[None]:
        """A whole forward under one adapter (echo scoring), waiting for its weights."""
        if adapter is None:
            yield
            return
        weights = self.store.request(adapter).result()
        self.state.kernel = Single(weights.on(self.device, self.dtype))
        try:
            yield
        finally:
            self.state.kernel = None

    def loaded(self) -> list[str]:
        return self.slots.loaded()


class LoraRun:
    """One scheduler run's adapter bookkeeping."""

    def __init__(self, lora: Lora, seqs: Sequence[Seq | None]) -> None:
        self.lora = lora
        self.seqs = seqs  # the batch slots' rows (slots.Slots.seqs, updated in place)
        self._round: set[Hashable] = set()
        self._pinned: set[Hashable] | None = None
        if lora.dense:
            dense_state(lora.state, lora.slots.max_loras, lora.max_tokens, lora.device)

    # --- admission ------------------------------------------------------------------------

    def new_round(self) -> None:
        self._round = set()
        self._pinned = None

    def pinned(self) -> set[Hashable]:
        if self._pinned is None:
            self._pinned = {q.job.adapter_key for q in self.seqs if q is not None}
            self._pinned.discard(None)
        return self._pinned | self._round

    def gate(self, unit: Unit) -> bool:
        """Whether the unit may be admitted now: no adapter, or its adapter in a slot
        (loaded now if a slot is free or held by an adapter no row uses)."""
        job = unit.job
        if job.adapter is None:
            return True
        weights = self.lora.weights(job)
        if weights is None:
            return False
        if self.lora.slots.acquire(weights, self.pinned()) is None:
            return False
        job.adapter_key = weights.key
        self._round.add(weights.key)
        return True

    def forget(self, keys: Sequence[tuple[str, str]]) -> None:
        self.lora.slots.forget(set(keys), self.pinned())

    # --- steps ----------------------------------------------------------------------------

    def slot_of(self, job: Job) -> int:
        """The token index of a job's rows: its adapter's slot + 1, 0 for the base."""
        key = job.adapter_key
        if key is None:
            return 0
        slot = self.lora.slots.slot(key)
        assert slot is not None, "a running row's adapter is pinned to its slot"
        return slot + 1

    def decode_index(self, n: int) -> list[int]:
        return [0 if q is None else self.slot_of(q.job) for q in self.seqs[:n]]

    @contextmanager
    def step(self, segments: Sequence[tuple[int, int]]) -> Iterator[bool]:
        """The forward in the context adds the deltas of tokens laid out as `segments`
        ((token index, tokens) in the forward's token order); yields whether any has
        an adapter."""
        state = self.lora.state
        if not any(index for index, _ in segments):
            state.kernel = None
            yield False
            return
        try:
            tokens = sum(count for _, count in segments)
            # Longer than the dense index (a padded prefill): grouped, eagerly, as it runs.
            if self.lora.dense and state.index is not None and tokens <= state.index.shape[0]:
                self._dense(segments)
            else:
                self._grouped(segments)
            yield True
        finally:
            state.kernel = None

    def _grouped(self, segments: Sequence[tuple[int, int]]) -> None:
        groups: dict[int, list[int]] = {}
        at = 0
        for index, count in segments:
            if index:
                groups.setdefault(index - 1, []).extend(range(at, at + count))
            at += count
        ranks = self.lora.slots.ranks
        rank = max(ranks[slot] for slot in groups)
        self.lora.state.kernel = Grouped(sorted(groups.items()), rank, self.lora.device)

    def _dense(self, segments: Sequence[tuple[int, int]]) -> None:
        state = self.lora.state
        assert state.index is not None
        values = [index for index, count in segments for _ in range(count)]
        pin = self.lora.device.type == "cuda"
        host = torch.tensor(values, dtype=torch.long, pin_memory=pin)
        state.index[: len(values)].copy_(host, non_blocking=True)
        state.kernel = Dense(state)


def segments_of(decode: Sequence[int], prompts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token segments of a varlen step: one token per decode row, then each prompt's."""
    return [(i, 1) for i in decode] + list(prompts)
