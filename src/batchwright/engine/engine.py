"""The engine: a model loaded once (`Engine.load(spec)`), and runs over it (`engine.run`).

`run` takes validated requests (prompt ids and sampling parameters: EngineRequest) and
hands out a result per request, the finished job in it. Wire lines are parsed, validated
against the model and tokenized outside the engine, off its thread (batchwright/serving's
preparer), which also builds the wire object of each result. A step is the work of three
parts:

- the scheduler (scheduling/) decides what runs: online requests first, batch lines into
  the rows and KV blocks left, preempting batch rows for online ones; it returns a plan;
- the model runner (runner/) owns the device state and turns the plan into one forward
  and one sampling step;
- the output processor (output/) records the sampled tokens (text, stops, grammars),
  emits stream deltas and collects the results.

The runner and its device state live as long as the loaded model, across runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from batchwright.engine.loading.loader import LoadedModel, load_model
from batchwright.engine.output.processor import OutputProcessor
from batchwright.engine.platform.host_memory import freeze_heap
from batchwright.engine.requests.feed import LaneFeed
from batchwright.engine.requests.jobs import start
from batchwright.engine.requests.observer import Observer
from batchwright.engine.requests.types import GenResult
from batchwright.engine.runner.forward import Forward
from batchwright.engine.runner.model_runner import ModelRunner
from batchwright.engine.sampling.grammar import Grammars
from batchwright.engine.scheduling.intake import Item, Scoring
from batchwright.engine.scheduling.scheduler import Limits, Plan, Scheduler
from batchwright.engine.text.text import GrowingText, Text
from batchwright.registry import ModelSpec

Cancelled = Callable[[], AbstractSet[Any]]


class Engine:
    def __init__(self, lm: LoadedModel, spec: ModelSpec) -> None:
        self.lm = lm
        self.spec = spec
        self.model_name = spec.name
        self.system_fingerprint = lm.fingerprint
        # Both may change between runs (the worker halves max_rows after running out of
        # memory, tests force a backend): the runner is rebuilt for them.
        self.max_rows = max(1, spec.max_rows)
        self.attention_backend = lm.backend
        self.max_batch_tokens = max(1, spec.max_batch_tokens)
        self._tok = lm.tokenizer
        self.text = Text(lm.tokenizer)
        self.grammars = Grammars(lm.tokenizer, lm.vocab_size, lm.eos_ids)
        self.observers: list[Observer] = []
        self.forward = Forward(lm, spec, self.observers)
        # LoRA adapters in this model's forward (engine/lora/), None with max_loras 0.
        self.lora = self.forward.lora
        self._runner: ModelRunner | None = None
        self._running = False  # a run holds the runner
        self.start = functools.partial(
            start, decode=self.text.decode, eos_ids=lm.eos_ids, grow=self.text.text_stream
        )

    @classmethod
    def load(cls, spec: ModelSpec) -> Engine:
        engine = cls(load_model(spec), spec)
        # What loading left alive lives as long as the process: out of the collector's
        # full passes, which walked it all (host_memory.py).
        freeze_heap()
        return engine

    def observe(self, observer: Observer) -> None:
        """Tell `observer` of every forward and result (worker metrics, progress lines)."""
        if observer not in self.observers:
            self.observers.append(observer)

    @property
    def runner(self) -> ModelRunner:
        """The device state: built at the first run, kept while rows and backend stay."""
        r = self._runner
        if r is None or (r.max_rows, r.backend) != (self.max_rows, self.attention_backend):
            self._runner = None  # its pools go before the new ones are allocated
            r = self._runner = self._new_runner()
        return r

    def new_runner(self) -> ModelRunner:
        """Device state built afresh, now (tests that change the spec between runs)."""
        self._runner = None
        self._runner = self._new_runner()
        return self._runner

    def _new_runner(self) -> ModelRunner:
        return ModelRunner(self.lm, self.spec, self.forward, self.max_rows, self.attention_backend)

    # The model's text, as the engine's own (text/text.py).

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    def token_text(self, token: int) -> str:
        return self.text.token_text(token)

    def token_piece(self, token: int) -> str:
        return self.text.token_piece(token)

    def text_stream(self) -> GrowingText:
        return self.text.text_stream()

    def run(
        self,
        requests: Iterable[Item],
        cancelled: Cancelled | None = None,
        online: LaneFeed | None = None,
    ) -> Iterator[GenResult]:
        """Results as requests complete. `requests` yields validated requests (and the
        results of lines the preparer refused, passed on in their place, and WAKE);
        `cancelled`, called at most once per step, returns request keys to drop at once
        (running or waiting): no result comes for them. `online`: the lane's feed
        (requests/feed.py's LaneFeed), online requests admitted ahead of `requests`,
        streamed (scheduling/lane.py)."""
        results = self._run(requests, cancelled, online)
        if not self.observers:
            return results
        return self._observed(results)

    def _observed(self, results: Iterator[GenResult]) -> Iterator[GenResult]:
        for result in results:
            for observer in self.observers:
                observer.finished(result)
            yield result

    def _run(
        self, requests: Iterable[Item], cancelled: Cancelled | None, feed: LaneFeed | None
    ) -> Iterator[GenResult]:
        # A second run while one is still open (a caller holding two generators) gets
        # device state of its own, for that run only.
        own = self._running
        runner = self._new_runner() if own else self.runner
        self._running = self._running or not own
        out = OutputProcessor(self.text, feed)
        limits = Limits(self.max_rows, self.max_batch_tokens, self.spec.online_rows, self.lm.varlen)
        sched = Scheduler(
            runner,
            requests,
            feed,
            out,
            limits=limits,
            start=self.start,
        )
        runner.begin(out)
        try:
            while True:
                if cancelled is not None and (keys := cancelled()):
                    sched.drop(keys)
                    runner.cancel(keys)
                plan = yield from _planned(sched.plan(), runner)
                if plan.compact:
                    # Rows move only when no step's tokens are still to be recorded: the
                    # host waits for the step in flight only when rows will move.
                    runner.drain()
                    yield from self._emit(out, runner)
                    runner.compact()
                if plan.stuck:
                    yield sched.reject_head()
                    continue
                if plan.units or runner.live:
                    runner.step(plan.units)
                else:
                    runner.drain()
                yield from self._emit(out, runner)
                if not plan.units and runner.idle and sched.drained:
                    return
        except Exception:
            if runner is self._runner:
                self._runner = None  # a step failed half way: the next run starts afresh
            raise
        finally:
            runner.reset()
            if not own:
                self._running = False

    @staticmethod
    def _emit(out: OutputProcessor, runner: ModelRunner) -> list[GenResult]:
        """The step's deltas of streamed requests go out before its results."""
        out.emit(runner.lane_rows)
        return out.results()


def _planned(
    plan: Generator[GenResult | Scoring, None, Plan], runner: ModelRunner
) -> Generator[GenResult, None, Plan]:
    """The scheduler's plan, its results passed on. The echo scores it asks for are the
    runner's to compute, at once: the plan resumes with them in place, or with what
    failed thrown back in (that request's 500, intake.py), as if it had scored itself."""
    try:
        failed: Exception | None = None
        while True:
            try:
                item = next(plan) if failed is None else plan.throw(failed)
            except StopIteration as stop:
                done: Plan = stop.value
                return done
            failed = None
            if not isinstance(item, Scoring):
                yield item
                continue
            try:
                runner.score(item.job)
            except Exception as exc:
                failed = exc
    finally:
        plan.close()  # the run stopped early: as `yield from` would have closed it
