"""Wire lines into an engine run, for callers that hold GenRequests and no thread to
prepare them on (tests, benches): `prepared` prepares each line as the engine reads it
(on the engine's thread, by the engine's preparer: prepare.py), and `serve` runs the
engine over such lines and an online feed, each result's Completion or chat.completion
built.

The worker prepares its lines off the engine's thread instead (the claim read-ahead, the
lease-process reader, the online taker) and builds results with `Wire` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

from batchwright.engine.engine import Cancelled, Engine
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.engine.scheduling.intake import Item
from batchwright.serving.prepare import Prepare, preparer_for
from batchwright.serving.wire import Wire


def serve(
    engine: Engine,
    lines: Iterable[Item | GenRequest],
    cancelled: Cancelled | None = None,
    online: Any = None,
) -> Iterator[GenResult]:
    """`engine.run` over `lines` (and an online feed), wire lines prepared as they are
    read, results built."""
    wire = Wire(engine)
    feed = None if online is None else prepared_feed(engine, online)
    for result in engine.run(prepared(engine, lines), cancelled, feed):
        yield wire(result)


def prepared(engine: Engine, lines: Iterable[Item | GenRequest]) -> Iterable[Item]:
    """`lines` as `engine.run` takes them: its wire lines prepared as they are read (a
    bench's stand-in engine, which has no preparer, takes them as they are)."""
    prepare = preparer_for(engine)
    return cast(Iterable[Item], lines) if prepare is None else Prepared(lines, prepare)


def prepared_feed(engine: Engine, feed: Any) -> Any:
    """An online feed whose `take` may hand wire lines, as `engine.run` takes it."""
    prepare = preparer_for(engine)
    return feed if prepare is None else PreparedFeed(feed, prepare)


class Prepared:
    """A source whose lines may still be wire lines (GenRequest): those are prepared as the
    engine reads them. What the engine asks of a source (`ready()`, `orders_ahead`) is
    the source's own."""

    def __init__(self, source: Iterable[Item | GenRequest], prepare: Prepare) -> None:
        self.source = source
        self.prepare = prepare
        ready = getattr(source, "ready", None)
        if ready is not None:
            self.ready = ready
        self.orders_ahead = bool(getattr(source, "orders_ahead", False))

    def __iter__(self) -> Iterator[Item]:
        prepare = self.prepare
        for item in self.source:
            yield prepare(item) if isinstance(item, GenRequest) else item


class PreparedFeed:
    """A lane feed (engine/requests/feed.py) that may hand wire lines, as one of requests
    (the rest of it is the feed's own)."""

    def __init__(self, feed: Any, prepare: Prepare) -> None:
        self.feed = feed
        self.prepare = prepare

    def take(self) -> list[EngineRequest | GenResult]:
        prepare = self.prepare
        return [prepare(x) if isinstance(x, GenRequest) else x for x in self.feed.take()]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.feed, name)
