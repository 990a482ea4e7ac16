"""The engine's cancel hook: `Engine.run(requests, cancelled=...)` drops the requests whose
keys it returns at the next step, running or still waiting, and yields nothing for them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchwright.engine.engine import Engine
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.serving.lines import serve

# EOS pushed out of reach so every row runs its full max_tokens unless cancelled.
_BODY = {"model": "test", "max_tokens": 120, "temperature": 0, "logit_bias": {}}


def _requests(engine: Engine, n: int) -> list[GenRequest]:
    eos = {str(t): -100 for t in engine.lm.eos_ids}
    return [
        GenRequest(i, {**_BODY, "prompt": f"Story {i}: once upon a time", "logit_bias": eos})
        for i in range(n)
    ]


class Hook:
    """Counts calls (one per step at most) and cancels `keys` from call `at` on."""

    def __init__(self, keys: set[Any], at: int) -> None:
        self.keys, self.at, self.calls = keys, at, 0

    def __call__(self) -> set[Any]:
        self.calls += 1
        return self.keys if self.calls >= self.at else set()


def _run(engine: Engine, reqs: list[GenRequest], hook: Callable[[], set[Any]] | None) -> Any:
    return {r.key: r for r in serve(engine, reqs, cancelled=hook)}


def _texts(results: dict[Any, GenResult]) -> dict[Any, Any]:
    return {k: r.completion["choices"] if r.completion else r.error for k, r in results.items()}


def test_running_rows_are_dropped_and_others_unchanged(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=8)
    reqs = _requests(engine, 6)
    hook = Hook({0, 2, 4}, at=5)
    got = _run(engine, reqs, hook)
    assert set(got) == {1, 3, 5}
    # The survivors ran as if alone: cancelling neighbours changes nothing about them.
    alone = _run(engine, [r for r in reqs if r.key in {1, 3, 5}], None)
    assert _texts(got) == _texts(alone)
    assert all(r.completion_tokens == 120 for r in got.values())


def test_cancel_everything_stops_at_the_next_step(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=8)
    reqs = _requests(engine, 4)
    hook = Hook({0, 1, 2, 3}, at=3)
    assert _run(engine, reqs, hook) == {}
    # 120 tokens would take 120 steps; the run ended right after the cancel was seen.
    assert hook.calls <= 4, hook.calls


def test_waiting_requests_are_dropped_too(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=4)
    reqs = _requests(engine, 10)
    hook = Hook({7, 8, 9}, at=1)  # the first step: those are still waiting for a row
    got = _run(engine, reqs, hook)
    assert set(got) == set(range(7))


def test_empty_set_changes_nothing(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=4)
    reqs = _requests(engine, 5)
    hook = Hook(set(), at=1)
    with_hook = _run(engine, reqs, hook)
    assert _texts(with_hook) == _texts(_run(engine, reqs, None))
    assert hook.calls >= 120  # asked once per step
