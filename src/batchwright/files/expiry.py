"""File lifetimes: `expires_after` on upload, `output_expires_after` on batches, and the
check that a batch's input still exists when it is validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.config import Settings
from batchwright.db.base import now
from batchwright.db.models import Batch, File
from batchwright.errors import InvalidRequest

MIN_SECONDS = 3600
MAX_SECONDS = 30 * 24 * 3600
ANCHORS = {"created_at"}


def parse(value: Mapping[str, Any] | None, param: str) -> int | None:
    """Seconds from an `{anchor: "created_at", seconds: N}` object, or a 400 naming the field."""
    if value is None:
        return None
    anchor = value.get("anchor")
    if anchor not in ANCHORS:
        raise InvalidRequest(
            f"Invalid value for '{param}.anchor': {str(anchor)[:32]!r}. Supported: 'created_at'.",
            param=f"{param}.anchor",
            code="invalid_value" if anchor is not None else "missing_required_parameter",
        )
    raw = value.get("seconds")
    try:
        seconds = int(str(raw)) if not isinstance(raw, bool) else None
    except ValueError:
        seconds = None
    if seconds is None:
        raise InvalidRequest(
            f"Invalid value for '{param}.seconds': expected an integer number of seconds.",
            param=f"{param}.seconds",
            code="invalid_type" if raw is not None else "missing_required_parameter",
        )
    if seconds < MIN_SECONDS:
        raise InvalidRequest(
            f"Invalid '{param}.seconds': {seconds} is below the minimum of {MIN_SECONDS} (1 hour).",
            param=f"{param}.seconds",
            code="integer_below_min_value",
        )
    if seconds > MAX_SECONDS:
        raise InvalidRequest(
            f"Invalid '{param}.seconds': {seconds} is above the maximum of {MAX_SECONDS} "
            "(30 days).",
            param=f"{param}.seconds",
            code="integer_above_max_value",
        )
    return seconds


def from_form(fields: Mapping[str, str]) -> dict[str, str] | None:
    """Multipart clients (the openai SDK among them) send `expires_after[anchor]` etc."""
    found = {
        key[len("expires_after[") : -1]: value
        for key, value in fields.items()
        if key.startswith("expires_after[") and key.endswith("]")
    }
    return found or None


def apply_upload_expiry(file: File, fields: Mapping[str, str], settings: Settings) -> None:
    seconds = parse(from_form(fields), "expires_after")
    if seconds is None and file.purpose == "batch" and settings.batch_file_expires_seconds > 0:
        seconds = settings.batch_file_expires_seconds
    file.expires_at = file.created_at + seconds if seconds is not None else None


def apply_output_expiry(file: File, batch: Batch) -> None:
    if batch.output_expires_after is not None:
        file.expires_at = file.created_at + batch.output_expires_after


def is_expired(file: File) -> bool:
    return file.expires_at is not None and file.expires_at <= now()


def input_gone(session: Session, batch: Batch) -> bool:
    """Fail the batch if its input file expired (or was deleted) before validation read it.

    Otherwise the file row is share-locked for the rest of the transaction, so the purge
    (which skips locked rows) cannot remove chunks while validation reads them.
    """
    file = session.scalar(
        select(File).where(File.id == batch.input_file_id).with_for_update(read=True)
    )
    if file is not None and not is_expired(file):
        return False
    what = f"expired at {file.expires_at}" if file is not None else "was deleted"
    batch.status, batch.failed_at = "failed", now()
    batch.errors = [
        {
            "code": "input_file_expired" if file is not None else "input_file_deleted",
            "line": None,
            "message": f"The input file {batch.input_file_id} {what} before the batch "
            "ran; upload it again and create a new batch.",
            "param": "input_file_id",
        }
    ]
    return True
