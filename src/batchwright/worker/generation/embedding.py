"""An embedding model as the worker runs it: the engine host's `run(requests, cancelled,
online)` contract over the embedding engine (engine/embed/), with the wire built here.

Batch lines and online requests come in as the generation engine gets them (GenRequest:
the body as sent); each body is checked as /v1/embeddings takes it (protocol/embeddings.py),
its inputs go to the engine as token ids, and what comes back (vectors and the tokens read)
goes out as the CreateEmbeddingResponse of a GenResult. Leases, the results writer, the
relay, fair share, cancels and `batchwright run` see an engine like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from batchwright.engine.requests.observer import Observer
from batchwright.engine.requests.types import GenRequest, GenResult, Wake
from batchwright.protocol.embeddings import MAX_REQUEST_TOKENS, check_embedding_body, embedding_body
from batchwright.protocol.endpoints import EMBEDDINGS, endpoint_of, task_error

if TYPE_CHECKING:
    from batchwright.engine.embed.engine import Embedded, EmbedEngine, EmbedJob


class EmbeddingRunner:
    """What worker/generation/runner.py loads for a model whose registry entry embeds."""

    def __init__(self, engine: EmbedEngine) -> None:
        self.engine = engine
        self.lm = engine.lm
        self.spec = engine.spec
        self.model_name = engine.model_name
        self.system_fingerprint = engine.system_fingerprint
        self.observers: list[Observer] = []

    def observe(self, observer: Observer) -> None:
        """As the generation engine's `observe`: each forward and each result."""
        if observer not in self.observers:
            self.observers.append(observer)
        self.engine.on_forward = self._forward

    def _forward(self, seconds: float, tokens: int) -> None:
        for observer in self.observers:
            observer.forward(seconds, tokens)

    @property
    def max_rows(self) -> int:
        return self.engine.max_rows

    @max_rows.setter
    def max_rows(self, rows: int) -> None:
        # Out of memory (engine_host.py halves it): fewer tokens per forward, too.
        self.engine.max_batch_tokens = max(
            1, self.engine.max_batch_tokens * rows // self.engine.max_rows
        )
        self.engine.max_rows = rows

    def job(self, greq: GenRequest, *, online: bool = False) -> EmbedJob:
        from batchwright.engine.embed.engine import EmbedJob

        body = greq.body
        if endpoint_of(body) != EMBEDDINGS:
            why = task_error(endpoint_of(body), self.model_name, "embed")
            error: dict[str, Any] | None = {
                "message": why,
                "type": "invalid_request_error",
                "param": "model",
                "code": None,
            }
            return EmbedJob(key=greq.key, error=error)
        req, error = check_embedding_body(body)
        if req is None:
            return EmbedJob(key=greq.key, error=error)
        job = self.engine.job(
            greq.key,
            req.inputs,
            dims=req.dimensions,
            group=greq.group,
            online=online,
            max_tokens=MAX_REQUEST_TOKENS,
        )
        job.meta = req.encoding_format
        return job

    def result(self, out: Embedded | EmbedJob) -> GenResult:
        from batchwright.engine.embed.engine import EmbedJob

        if isinstance(out, EmbedJob):
            return GenResult(key=out.key, status_code=400, error=out.error)
        vectors = [v.numpy() for v in out.vectors]
        body = embedding_body(self.model_name, vectors, out.tokens, str(out.job.meta or "float"))
        return GenResult(
            key=out.job.key, status_code=200, completion=body, prompt_tokens=out.tokens
        )

    def run(
        self,
        requests: Iterable[GenRequest],
        cancelled: Callable[[], AbstractSet[Any]] | None = None,
        online: Any = None,
    ) -> Iterator[GenResult]:
        feed = _Feed(self, online) if online is not None else None
        for out in self.engine.run(_Jobs(self, requests), cancelled, feed):
            result = self.result(out)
            for observer in self.observers:
                observer.finished(result)
            yield result


class _Jobs:
    """The request source as jobs, keeping what the engine asks of a source (`ready`)."""

    def __init__(self, runner: EmbeddingRunner, requests: Iterable[GenRequest]) -> None:
        self.runner = runner
        self.it = iter(requests)
        ready = getattr(requests, "ready", None)
        if ready is not None:
            self.ready = ready

    def __iter__(self) -> Iterator[EmbedJob]:
        return self

    def __next__(self) -> EmbedJob:
        from batchwright.engine.embed.engine import WAKE as EMBED_WAKE

        greq: GenRequest | Wake = next(self.it)
        if isinstance(greq, Wake):
            return EMBED_WAKE
        return self.runner.job(greq)


class _Feed:
    """The relay's online requests as jobs (engine/embed/engine.py's Feed)."""

    def __init__(self, runner: EmbeddingRunner, online: Any) -> None:
        # The worker's RelayPump (pump.py): its lines come unprepared (no preparer here).
        self.runner = runner
        self.online = online

    def take(self) -> list[EmbedJob]:
        return [self.runner.job(g, online=True) for g in self.online.take()]

    def started(self, key: Any, prompt_tokens: int) -> None:
        self.online.started(key, prompt_tokens)

    def rows(self, online: int) -> None:
        self.online.rows(online)
