"""An engine run over wire lines with wire objects back, for callers that hold
GenRequests (tests, benches): the engine prepares such lines as it reads them; each result
gets its Completion or chat.completion built.

The worker prepares its lines off the engine's thread instead (the claim read-ahead, the
lease-process reader, the online taker) and builds results with `Wire` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from batchwright.engine.engine import Cancelled, Engine
from batchwright.engine.requests.types import GenResult
from batchwright.serving.wire import Wire


def serve(
    engine: Engine,
    lines: Iterable[Any],
    cancelled: Cancelled | None = None,
    online: Any = None,
) -> Iterator[GenResult]:
    """`engine.run` over `lines` (and an online feed), results built."""
    wire = Wire(engine)
    for result in engine.run(lines, cancelled, online):
        yield wire(result)
