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
    text,
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
    # Share of a model's capacity relative to other projects
    # (worker/lease_child/fairshare.py); None: the default weight. Quotas
    # (batches/quotas.py); None: no limit.
    weight: Mapped[float | None] = mapped_column(Float)
    max_enqueued_lines: Mapped[int | None] = mapped_column(BigInteger)
    max_enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)
    # Online /v1/completions rate limits (online/ratelimit.py); None: no limit.
    online_requests_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    online_tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)


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


class DashboardSession(Base):
    """A dashboard sign-in (auth/sessions.py): the cookie holds a random token, the row its
    sha256. It acts for the key it was opened with, and ends with it."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the token
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_project_created", "project_id", "created_at", "id"),
        Index("ix_files_expires_at", "expires_at"),
    )

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
    # Runs of validate/finalize that raised: bounded by max_batch_failures (batches/redrive.py).
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Prompt tokens plus max_tokens of its lines, counted at validation for the quota.
    enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)
    # output_expires_after.seconds: the lifetime of the output and error files.
    output_expires_after: Mapped[int | None] = mapped_column(Integer)


class BatchRequest(Base):
    """One input line: the unit of claiming, retrying and output."""

    __tablename__ = "batch_requests"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_requests_custom_id"),
        UniqueConstraint("batch_id", "line_no", name="uq_batch_requests_line_no"),
        Index("ix_batch_requests_claim", "state", "batch_id", "line_no"),
        Index("ix_batch_requests_lease", "lease_token"),
        Index(
            "ix_batch_requests_running",
            "batch_id",
            postgresql_where=text("state = 'running'"),
            sqlite_where=text("state = 'running'"),
        ),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line_no: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    # The line's body as JSON text: Postgres jsonb cannot hold \u0000, clients can send it.
    body: Mapped[str] = mapped_column(Text)
    # queued -> running -> succeeded | failed | cancelled | expired
    state: Mapped[str] = mapped_column(String(16))
    # Runs charged to the line itself (its own errors); see controlplane/budget.py.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Runs lost to the infrastructure (worker death, lost lease, database, broker, OOM).
    infra_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Runs that failed with other lines in them: which one failed them is unknown.
    shared_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
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


class OnlineUsage(Base):
    """One online /v1/completions request and how it went (online/usage.py writes them in
    batches, off the request path)."""

    __tablename__ = "online_requests"
    __table_args__ = (Index("ix_online_requests_project_created", "project_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the Completion's id
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)  # unix time the request arrived
    stream: Mapped[bool] = mapped_column(default=False)
    # The HTTP status it ended with (a stream's error event counts as its status; a client
    # that left mid-way: 499) and the error's code.
    status: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Seconds from arrival to the first chunk sent (streams) and to the end.
    time_to_first_token: Mapped[float | None] = mapped_column(Float)
    duration: Mapped[float] = mapped_column(Float)
    finish_reasons: Mapped[list[str] | None] = mapped_column(JSON)
    disconnected: Mapped[bool] = mapped_column(default=False)


class WorkerHeartbeat(Base):
    """A live worker process: what it serves and how busy it is (written by worker/stats.py,
    read by controlplane/heartbeats.py)."""

    __tablename__ = "worker_heartbeats"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # host:pid
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    # Comma-separated model names it takes work for ("" for a control-only worker), and
    # those it has loaded so far.
    models: Mapped[str] = mapped_column(Text)
    loaded: Mapped[str] = mapped_column(Text, default="")
    # Models it refused at load and why, as a JSON object (engine/loading/model_support.py): it
    # does not take work for them, and /v1/models and validation say why.
    refused: Mapped[str] = mapped_column(Text, default="", server_default="")
    # Comma-separated LoRA adapters it holds (read and in device slots), engine/lora/.
    adapters: Mapped[str] = mapped_column(Text, default="")
    control: Mapped[bool] = mapped_column(default=True)
    rows_in_flight: Mapped[int] = mapped_column(Integer, default=0)
    tokens_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    lines_completed: Mapped[int] = mapped_column(BigInteger, default=0)
    started_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float, index=True)


class LoraAdapter(Base):
    """A LoRA adapter added at run time (`batchwright adapters add`): a model name served
    in its base model's forward (catalog/, engine/lora/). `path` is the PEFT folder on
    the base's workers."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    base: Mapped[str] = mapped_column(String(200), index=True)
    path: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[str] = mapped_column(Text)  # comma-separated, as checked
    created_at: Mapped[int] = mapped_column(BigInteger)


class WebhookEndpoint(Base):
    """Where a project's batch events are posted; the secret signs every delivery."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    # whsec_ + base64 key. Kept readable: every delivery is signed with it.
    secret: Mapped[str] = mapped_column(String(100))
    # Event types delivered; null means all.
    event_types: Mapped[list[str] | None] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)


class WebhookDelivery(Base):
    """The outbox: one row per event and endpoint, written with the state change."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "state", "next_attempt_at"),)

    # Also the webhook-id header: the same on every retry, so receivers can deduplicate.
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True
    )
    event_type: Mapped[str] = mapped_column(String(32))
    # The exact JSON body that is signed and sent.
    payload: Mapped[str] = mapped_column(Text)
    # pending -> delivered | failed (retry window over)
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    # A sender holds the row until then; a sender killed mid-request leaves it to expire.
    claimed_until: Mapped[float | None] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
