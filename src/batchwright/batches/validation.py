"""Batch input validation: stream the input file once, turn each line into a request row.

File-level problems (not JSON, custom_id, method, url, model) fail the batch with line
numbers; a body the model would reject becomes a failed row (a 400 in the error file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import delete, insert
from sqlalchemy.orm import Session

from batchwright.batches.prefix_key import prefix_key
from batchwright.batches.quotas import TokenCounter, over_limit
from batchwright.config import Settings
from batchwright.controlplane import heartbeats
from batchwright.db.models import Batch, BatchRequest
from batchwright.files.storage import iter_lines
from batchwright.protocol.embeddings import EmbeddingRequest
from batchwright.protocol.endpoints import ENDPOINTS, LineRequest, check_body, task_error
from batchwright.registry import Registry

MAX_REPORTED_ERRORS = 100
INSERT_BATCH = 1000
BOM = b"\xef\xbb\xbf"


@dataclass
class LineError:
    code: str
    line: int
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


@dataclass
class Outcome:
    errors: list[LineError] = field(default_factory=list)
    total: int = 0
    rejected: int = 0
    model: str | None = None
    tokens: int = 0  # enqueued tokens (batches/quotas.py)
    inputs: int = 0  # embedding inputs (an array counts each element)


class _Rows:
    """Accumulates request rows and inserts them a thousand at a time."""

    def __init__(self, session: Session, batch_id: str) -> None:
        self.session, self.batch_id, self.pending = session, batch_id, []  # type: ignore[var-annotated]

    def add(self, **row: Any) -> None:
        self.pending.append({"batch_id": self.batch_id, "attempts": 0, **row})
        if len(self.pending) >= INSERT_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.session.execute(insert(BatchRequest), self.pending)
            self.pending = []


def _parse_line(
    raw: bytes, line_no: int, endpoint: str
) -> tuple[dict[str, Any] | None, LineError | None]:
    def err(code: str, message: str, param: str | None = None) -> LineError:
        return LineError(code, line_no, f"Line {line_no}: {message}", param)

    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson rejects invalid UTF-8 and nesting deeper than 1024 here too.
        return None, err("invalid_json_line", f"not valid JSON ({str(exc)[:120]}).")
    if not isinstance(obj, dict):
        return None, err("invalid_json_line", "each line must be a JSON object.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, err(
            "missing_custom_id", "'custom_id' must be a non-empty string.", "custom_id"
        )
    if "\x00" in custom_id or len(custom_id) > 512:
        return None, err(
            "invalid_custom_id",
            "'custom_id' must be at most 512 characters with no NUL.",
            "custom_id",
        )
    if obj.get("method") != "POST":
        return None, err("invalid_method", "'method' must be 'POST'.", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return None, err("invalid_url", f"'url' must be one of {', '.join(ENDPOINTS)}.", "url")
    if url != endpoint:
        # OpenAI's code: a file holds lines of its batch's endpoint only.
        return None, err(
            "url_mismatch", f"'url' is {url!r}, but the batch's endpoint is {endpoint!r}.", "url"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return None, err("invalid_body", "'body' must be a JSON object.", "body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        return None, err("missing_model", "'body.model' must be a non-empty string.", "body.model")
    return obj, None


def _body_row(
    line_no: int, custom_id: str, body: dict[str, Any], settings: Settings, endpoint: str
) -> tuple[dict[str, Any], LineRequest | None]:
    """The request row for a line: queued, or failed with the 400 the model would give.

    Whatever a body makes the checks raise is that line's 400, never the batch's problem:
    an exception here would leave the whole batch validating while it is re-driven."""
    row: dict[str, Any] = {"line_no": line_no, "custom_id": custom_id, "state": "queued"}
    request: LineRequest | None = None
    try:
        request, error = check_body(endpoint, body, settings.max_sequences_per_line)
        row["body"] = orjson.dumps(body).decode()
    except Exception as exc:
        # orjson stores at most 254 levels of nesting; RecursionError and the like too.
        row["body"] = "{}"
        request = None
        deep = isinstance(exc, RecursionError) or "ecursion" in str(exc)
        why = "it nests deeper than 254 levels" if deep else f"{type(exc).__name__}: {exc}"
        error = {
            "message": f"Line {line_no}: the body cannot be processed: {why[:200]}.",
            "type": "invalid_request_error",
            "param": "body",
            "code": "invalid_body",
        }
    if error is not None:
        row.update(state="failed", status_code=400, error=orjson.dumps(error).decode())
    return row, request


# Errors that end the scan at their line: the file is over a limit, or every later line
# would fail the same way. Any other error ends it once MAX_REPORTED_ERRORS are reported.
_FILE_ERRORS = frozenset({"too_many_tasks", "invalid_model", "model_unavailable"})


def scan_input(session: Session, batch: Batch, registry: Registry, settings: Settings) -> Outcome:
    scan = _Scan(session, batch, registry, settings)
    lines = iter_lines(session, batch.input_file_id, settings.max_line_bytes)
    for line_no, raw in enumerate(lines, start=1):
        error = scan.line(line_no, raw)
        if error is not None:
            scan.out.errors.append(error)
            if error.code in _FILE_ERRORS or len(scan.out.errors) >= MAX_REPORTED_ERRORS:
                break
    out = scan.out
    if out.total == 0 and not out.errors:
        out.errors.append(LineError("empty_file", 0, "The input file holds no requests."))
    if out.errors:
        session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch.id))
    else:
        scan.rows.flush()
    return out


class _Scan:
    """The input file's lines, one at a time: each is stored as a request row, or is the
    error the line makes."""

    def __init__(
        self, session: Session, batch: Batch, registry: Registry, settings: Settings
    ) -> None:
        self.batch, self.registry, self.settings = batch, registry, settings
        self.out = Outcome()
        self.rows = _Rows(session, batch.id)
        self.seen: set[str] = set()
        self.counter: TokenCounter | None = None
        self.refusals = heartbeats.refusals(session, settings) if settings.broker_url else {}

    def line(self, line_no: int, raw: bytes | None) -> LineError | None:
        out, settings = self.out, self.settings
        if raw is None:
            out.total += 1
            return LineError(
                "line_too_long",
                line_no,
                f"Line {line_no}: longer than {settings.max_line_bytes} bytes.",
            )
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            return None  # blank lines carry no request; line numbers still count them
        out.total += 1
        if out.total > settings.max_batch_lines:
            return LineError(
                "too_many_tasks",
                line_no,
                f"The file holds more than {settings.max_batch_lines} requests.",
            )
        obj, error = _parse_line(raw, line_no, self.batch.endpoint)
        if obj is None:
            return error
        custom_id, body = obj["custom_id"], obj["body"]
        if custom_id in self.seen:
            return LineError(
                "duplicate_custom_id",
                line_no,
                f"Line {line_no}: custom_id {custom_id[:64]!r} appears twice.",
                "custom_id",
            )
        self.seen.add(custom_id)
        error = self._model(line_no, body["model"])
        if error is not None:
            return error
        if out.errors:
            return None  # the batch fails anyway: keep scanning for errors, store nothing
        return self._store(line_no, custom_id, body)

    def _model(self, line_no: int, model: str) -> LineError | None:
        """The line's model: one the registry serves, the same as the file's first line's."""
        out = self.out
        if self.registry.serving(model) is None:
            return LineError(
                "model_not_found",
                line_no,
                f"Line {line_no}: model {model[:64]!r} does not exist here; "
                f"available: {', '.join(self.registry.all_names)}.",
                "body.model",
            )
        if out.model is None:
            out.model = model
            spec = self.registry.get(model)
            why = task_error(self.batch.endpoint, model, spec.kind) if spec is not None else None
            if why is not None:
                # Every line of the file would fail the same way: the file's problem.
                return LineError("invalid_model", line_no, f"Line {line_no}: {why}", "body.model")
            why = self.refusals.get(model)
            if why is not None:
                # Every live worker of the model refused it at load: the batch would wait
                # for a worker that will never take it.
                return LineError(
                    "model_unavailable",
                    line_no,
                    f"Line {line_no}: model {model[:64]!r} cannot be served here: {why}",
                    "body.model",
                )
        elif model != out.model:
            return LineError(
                "mismatched_model",
                line_no,
                f"Line {line_no}: model {model[:64]!r} differs from "
                f"{out.model!r}; a batch uses one model.",
                "body.model",
            )
        return None

    def _store(self, line_no: int, custom_id: str, body: dict[str, Any]) -> LineError | None:
        out, settings = self.out, self.settings
        row, request = _body_row(line_no, custom_id, body, settings, self.batch.endpoint)
        row["prefix_key"] = prefix_key(body.get("prompt", body.get("messages")))
        if isinstance(request, EmbeddingRequest):
            out.inputs += request.input_count
            if out.inputs > settings.max_batch_embedding_inputs:
                limit = settings.max_batch_embedding_inputs
                return LineError(
                    "too_many_tasks",
                    line_no,
                    f"Line {line_no}: the file holds more than {limit} embedding inputs "
                    f"(the limit per batch; an input array counts each of its elements).",
                    "body.input",
                )
        if request is not None and row["state"] == "queued":
            self.counter = self.counter or TokenCounter(self.registry, out.model)
            out.tokens += self.counter.line(request)
        if row["state"] == "failed":
            out.rejected += 1
        self.rows.add(**row)
        return None


def enforce_quotas(session: Session, batch: Batch, outcome: Outcome) -> None:
    """Fail the batch's validation with `token_limit_exceeded` if it is over a quota;
    else record its tokens for the next batch's check."""
    why = over_limit(session, batch, outcome.total, outcome.tokens)
    if why is None:
        batch.enqueued_tokens = outcome.tokens
        return
    outcome.errors.append(LineError("token_limit_exceeded", 0, why))
    session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch.id))
