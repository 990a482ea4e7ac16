"""Tables. Postgres is the source of truth; SQLite serves the embedded default."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from batchwright.db.base import Base

# SQLite only autoincrements INTEGER PRIMARY KEY; Postgres gets a bigint.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[int] = mapped_column(BigInteger)


class APIKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    # sha256 of the secret: keys are high-entropy, so a fast hash is enough.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)


class FileChunk(Base):
    """File content lives in the database so API replicas and workers share no disk."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_project_created", "project_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Input tokens served from the engine's prefix cache (usage.input_tokens_details).
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    # Last time the sweeper or a worker pushed this batch; lets the sweeper spot stuck ones.
    updated_at: Mapped[float] = mapped_column(Float)


class BatchRequest(Base):
    """One input line: the unit of claiming, retrying and output."""

    __tablename__ = "batch_requests"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_requests_custom_id"),
        UniqueConstraint("batch_id", "line_no", name="uq_batch_requests_line_no"),
        Index("ix_batch_requests_claim", "state", "batch_id", "line_no"),
        Index("ix_batch_requests_lease", "lease_token"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line_no: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    # The line's body as JSON text: Postgres jsonb cannot hold \u0000, clients can send it.
    body: Mapped[str] = mapped_column(Text)
    # queued -> running -> succeeded | failed | cancelled | expired
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_token: Mapped[str | None] = mapped_column(String(40))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    # Error object (JSON text) for a failed line: {"message","type","param","code"}.
    error: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Lines with the same key start alike (batches/prefix_key.py); claims hand them out
    # together so a worker prefills their shared prefix once.
    prefix_key: Mapped[str | None] = mapped_column(String(16))


class Completion(Base):
    """One per successful request; unique per request row so a replayed write is a no-op."""

    __tablename__ = "completions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_row_id: Mapped[int] = mapped_column(
        ForeignKey("batch_requests.id", ondelete="CASCADE"), unique=True
    )
    batch_id: Mapped[str] = mapped_column(String(40), index=True)
    model: Mapped[str] = mapped_column(String(200))
    # The whole Completion object as JSON text (see BatchRequest.body on \u0000).
    body: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    total_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger)
