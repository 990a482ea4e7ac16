"""Render the output and error JSONL files, in input order, a row at a time."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.config import Settings
from batchwright.db.models import Batch, BatchRequest, Completion
from batchwright.files.expiry import apply_output_expiry
from batchwright.files.service import new_file
from batchwright.files.storage import ChunkWriter

# Messages for lines that never produced a response.
NEVER_RAN = {
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
    "expired": ("batch_expired", "The batch expired before this request ran."),
}


# Line breaks to str.splitlines() that JSON leaves unescaped. Escaping them keeps one request
# per line for clients that split the file that way; in UTF-8 these byte sequences can only
# occur inside strings, so the swap is always valid JSON.
_RAW_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def _stable_id(prefix: str, batch_id: str, line_no: int) -> str:
    digest = hashlib.sha256(f"{prefix}:{batch_id}:{line_no}".encode()).hexdigest()[:24]
    return prefix + digest


def _line(row: BatchRequest, batch_id: str, completion_body: str | None) -> bytes:
    line: dict[str, Any] = {
        "id": _stable_id("batch_req_", batch_id, row.line_no),
        "custom_id": row.custom_id,
        "response": None,
        "error": None,
    }
    request_id = _stable_id("req_", batch_id, row.line_no)
    if row.state == "succeeded" and completion_body is not None:
        # The stored Completion is already JSON: embed it without re-parsing.
        line["response"] = {
            "status_code": 200,
            "request_id": request_id,
            "body": orjson.Fragment(completion_body),
        }
    elif row.state in NEVER_RAN:
        code, message = NEVER_RAN[row.state]
        line["error"] = {"code": code, "message": message}
    else:
        error = (
            orjson.Fragment(row.error)
            if row.error
            else {
                "message": "The request failed.",
                "type": "server_error",
                "param": None,
                "code": "server_error",
            }
        )
        line["response"] = {
            "status_code": row.status_code or 500,
            "request_id": request_id,
            "body": {"error": error},
        }
    data = orjson.dumps(line)
    for raw, escaped in _RAW_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data + b"\n"


def render(session: Session, batch: Batch, settings: Settings) -> tuple[int, int]:
    """Write output and error files; set their ids on the batch. Returns line counts."""
    writers: dict[str, ChunkWriter] = {}

    def writer(kind: str) -> ChunkWriter:
        if kind not in writers:
            file = new_file(session, batch.project_id, f"{batch.id}_{kind}.jsonl", "batch_output")
            apply_output_expiry(file, batch)
            writers[kind] = ChunkWriter(session, file, settings.file_chunk_bytes)
        return writers[kind]

    query = (
        select(BatchRequest, Completion.body)
        .outerjoin(Completion, Completion.request_row_id == BatchRequest.id)
        .where(BatchRequest.batch_id == batch.id)
        .order_by(BatchRequest.line_no)
        .execution_options(yield_per=500)
    )
    counts = {"output": 0, "error": 0}
    for row, completion_body in session.execute(query):
        kind = "output" if row.state == "succeeded" else "error"
        writer(kind).write(_line(row, batch.id, completion_body))
        counts[kind] += 1
        session.expunge(row)
    if "output" in writers:
        batch.output_file_id = writers["output"].close().id
    if "error" in writers:
        batch.error_file_id = writers["error"].close().id
    return counts["output"], counts["error"]
