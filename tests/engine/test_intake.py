"""How requests reach rows: sources read without stalling the loop, groups sharing rows."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

from batchwright.engine.engine import Engine
from batchwright.engine.requests.types import GenRequest
from batchwright.serving.lines import serve

_END = object()


class Feed:
    """A source like the worker's claim read-ahead: a queue, and `ready()` its size."""

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue()

    def put(self, request: GenRequest | object) -> None:
        self.q.put(request)

    def ready(self) -> int:
        return self.q.qsize()

    def __iter__(self) -> Iterator[GenRequest]:
        while True:
            # The timeout only turns a stalled engine into a failure instead of a hang.
            item = self.q.get(timeout=60)
            if item is _END:
                return
            yield item


def _body(eos: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "test",
        "prompt": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": {str(eos): -100},  # exactly max_tokens each
    }


def test_a_request_arriving_while_rows_run_joins_them(
    make_engine: Callable[..., Engine],
) -> None:
    """The engine never waits on a ready-aware source while it has rows: line 1 arrives
    only after line 0's result, which the engine could not produce if it sat
    waiting for more input."""
    engine = make_engine(max_rows=4)
    eos = min(engine.lm.eos_ids)
    feed = Feed()
    feed.put(GenRequest("first", _body(eos, 3)))
    keys = []
    for result in serve(engine, feed):
        assert result.status_code == 200, result.error
        keys.append(result.key)
        if result.key == "first":
            feed.put(GenRequest("second", _body(eos, 3)))
            feed.put(_END)
    assert keys == ["first", "second"]


def test_a_small_group_starts_before_a_big_groups_window(
    make_engine: Callable[..., Engine],
) -> None:
    """Two rows, A's three lines read before B's: B's line takes the second row of the
    first step (fewest rows running) instead of waiting behind A's window."""
    engine = make_engine(max_rows=2)
    eos = min(engine.lm.eos_ids)
    feed = Feed()
    for i in range(3):
        feed.put(GenRequest(f"a{i}", _body(eos, 4), group="A"))
    feed.put(GenRequest("b0", _body(eos, 4), group="B"))
    feed.put(_END)
    order = [r.key for r in serve(engine, feed)]
    assert sorted(order) == ["a0", "a1", "a2", "b0"]
    assert "b0" in order[:2], order


def test_without_groups_the_window_runs_longest_first(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_rows=2)
    eos = min(engine.lm.eos_ids)
    reqs = [GenRequest(i, _body(eos, n)) for i, n in enumerate([2, 9, 2, 9])]
    order = [r.key for r in serve(engine, reqs)]
    # Rows 1 and 3 (9 tokens) were admitted first; the short ones ran after them.
    assert set(order[:2]) == {1, 3}, order


class OrderedFeed(Feed):
    """Like the worker's lease process window, which orders its lines itself (a newcomer
    batch's first): the engine should leave them there until rows can take them."""

    orders_ahead = True


def test_an_ordered_source_is_read_only_half_a_batch_ahead(
    make_engine: Callable[..., Engine],
) -> None:
    """When the first result comes out, the engine has taken its rows plus half a batch
    from a source that orders its own window (where the worker puts a newcomer batch's
    lines first), and its rows plus two batches from any other."""
    engine = make_engine(max_rows=4)
    eos = min(engine.lm.eos_ids)
    taken = {}
    for feed in (OrderedFeed(), Feed()):
        for i in range(20):
            feed.put(GenRequest(i, _body(eos, 5)))
        feed.put(_END)
        results = serve(engine, feed)
        first = next(results)
        assert first.status_code == 200, first.error
        taken[type(feed).__name__] = 20 + 1 - feed.ready()  # the end marker is queued too
        assert len([first, *results]) == 20
    assert taken == {"OrderedFeed": 4 + 2, "Feed": 4 + 8}
