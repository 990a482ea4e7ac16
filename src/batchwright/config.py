"""Typed settings: one class, env prefix BATCHWRIGHT_."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> Path:
    return Path.home() / ".cache" / "batchwright"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHWRIGHT_", env_file=".env", extra="ignore")

    # Empty database URL means the embedded default: SQLite under `home`.
    database_url: str = ""
    # Connections per process (SQLAlchemy pool). A worker uses up to three at once (claims,
    # result writes, lease renewals); see docs/scaling.md before raising it.
    database_pool_size: int = 5
    database_max_overflow: int = 5
    # Empty broker URL means no Celery: work runs in-process (embedded default).
    broker_url: str = ""
    # The Celery queue; deployments (or test runs) sharing one Redis use different names.
    queue: str = "batchwright"
    home: Path = Field(default_factory=_default_home)

    # Model registry: a TOML/JSON file, or inline JSON; see registry.py.
    models_file: Path | None = None
    models: str = ""

    max_upload_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    # /v1/embeddings batches: inputs across the file's lines, an array counting each element
    # (OpenAI's limit).
    max_batch_embedding_inputs: int = 50_000
    # One input line; a longer one fails validation instead of being held in memory.
    max_line_bytes: int = 32 * 1024 * 1024
    # Storage granularity of file content rows; also the download chunk size.
    file_chunk_bytes: int = 1024 * 1024
    # Completion window accepted in the API ("24h") and how long it really lasts;
    # tests shorten it to seconds.
    completion_window_seconds: int = 24 * 3600

    # Worker claiming.
    lease_seconds: int = 120
    claim_batch_size: int = 64
    # Failed runs of a line alone before it fails for good; a failed run it shared with
    # other lines uses none (controlplane/budget.py).
    max_attempts: int = 3
    # Runs of a line lost to worker deaths, lost leases, database/broker errors or OOM: they
    # do not use its attempts; past this many (the last ones alone) the line fails for good.
    max_infra_failures: int = 12
    # Times a batch's validate or finalize may raise before the batch ends `failed`.
    max_batch_failures: int = 3
    # Sequences one line may run (prompts x best_of, or x n): a line above it is a 400.
    max_sequences_per_line: int = 256
    # A process task gives the queue back after this long, so a worker's other models get
    # their turn (control work runs beside it, in its control worker: worker/supervisor.py).
    work_slice_seconds: float = 60.0
    sweep_interval_seconds: float = 15.0
    # How often a worker looks for cancelled batches among the lines it holds.
    cancel_poll_seconds: float = 2.0

    # Shared service (routing, heartbeats, fair share, metrics); see controlplane/routing.py.
    # Models this worker serves, comma-separated; empty: every model in the registry.
    worker_models: str = ""
    # A worker that only takes control work (validate, finalize, sweep): never imports torch.
    worker_control_only: bool = False
    # How often a worker records its heartbeat; it counts as live for three intervals.
    heartbeat_seconds: float = 5.0
    # Results waiting for the writer thread, in results; the generation loop blocks past it.
    result_queue_size: int = 256
    # On Postgres, claims and result writes run in a process beside the generation loop
    # (worker/generation/lease_process.py), not in threads that take the GIL from it.
    lease_process: bool = True
    # Intra-op threads of a model on the CPU; 0: one fewer than the cores with the lease
    # process (it and a local Postgres need one), else torch's default.
    torch_threads: int = 0
    # Port of a worker's Prometheus endpoint; 0: none.
    worker_metrics_port: int = 0
    # Default weight of a project in the fair share of a model (per project: `projects set`).
    default_project_weight: float = 1.0

    # Online /v1/completions (relay/, online/). A request no worker starts within the queue
    # timeout is answered 503. A worker counts as live for the relay while its key lives
    # (it renews it every third of that); a dead one's requests go to another worker, at
    # most `online_max_requeues` times. Events of a request stay this long in Redis.
    online_queue_timeout_seconds: float = 60.0
    online_worker_ttl_seconds: float = 3.0
    online_max_requeues: int = 3
    online_events_ttl_seconds: int = 3600
    # Usage rows (one per online request) are written in batches this often; at most this
    # many wait in an API process while the database is away (then new ones are dropped).
    online_usage_flush_seconds: float = 0.5
    online_usage_buffer: int = 100_000
    # Online requests one API process holds at once: past this many a request is a 503
    # with Retry-After; past `..._per_project` of one project, a 429 with Retry-After
    # (0: no cap). The events of every request come through one Redis read; short
    # commands share at most `online_redis_connections` connections, a request waiting
    # longer than `online_redis_pool_timeout_seconds` for one is a 503. Every Redis command
    # of the relay times out after `online_redis_timeout_seconds`.
    online_max_in_flight: int = 1024
    online_max_in_flight_per_project: int = 64
    online_redis_connections: int = 64
    online_redis_pool_timeout_seconds: float = 2.0
    online_redis_timeout_seconds: float = 10.0
    # A started request whose worker sends nothing this long (its engine ticks every
    # second or so while it holds the request) is given up with a 503 `engine_stalled`.
    online_idle_timeout_seconds: float = 120.0
    # Events a worker wrote that the API has not read yet, per request: past this the
    # reader is taken to have stopped reading and the request is dropped at the worker.
    online_max_unread_bytes: int = 16 * 1024 * 1024
    # Default online limits of a project that has none of its own (`projects set --rpm`,
    # `--tpm`); 0: none.
    online_default_requests_per_minute: int = 6000
    online_default_tokens_per_minute: int = 10_000_000
    # A response_format's grammar not compiled this long after its first request fails
    # its requests (a 400 naming response_format); 0: no limit.
    grammar_compile_seconds: float = 10.0
    # HTTP keep-alive of `batchwright serve`: an idle connection stays open this long, well
    # past the 5 to 60 s clients poll at (behind a proxy, make it longer than the proxy's).
    keep_alive_seconds: float = 75.0
    # Who may read /metrics and the per-model capacity in /readyz: a request with
    # `Authorization: Bearer <metrics_key>`; with no key set they are served only on the
    # listener of their own at metrics_host:metrics_port (0: none) that `serve` starts.
    metrics_key: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # A request body (JSON or form; uploads have their own limit) over this is a 413 before it
    # is read whole. Parsed JSON can take 30x its size (a list of empty lists): at 4 MiB the
    # API peaks near 225 MiB on the worst body (bench/api_body_memory.py).
    max_json_body_bytes: int = 4 * 1024 * 1024

    @field_validator("models_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # Compose passes `${BATCHWRIGHT_MODELS_FILE:-}` through as "" when it is not set.
        return None if value == "" else value

    # File expiry (issue 12). Uploads with purpose "batch" expire after this by default,
    # as OpenAI's do; 0 keeps them forever. Expired files are purged by the sweeper a
    # bounded number of chunks per transaction.
    batch_file_expires_seconds: int = 30 * 24 * 3600
    purge_chunks_per_step: int = 64
    purge_steps_per_task: int = 32
    # Webhooks: targets in private, loopback or link-local networks are refused unless
    # allowed (a webhook URL must not reach into the operator's own network).
    webhook_allow_private_targets: bool = False
    webhook_timeout_seconds: float = 10.0
    # Retries back off exponentially with full jitter, up to this cap per wait, for up
    # to webhook_retry_window_seconds after the event.
    webhook_retry_base_seconds: float = 5.0
    webhook_retry_max_seconds: float = 3600.0
    webhook_retry_window_seconds: int = 72 * 3600
    # Dashboard sign-ins last this long (a session, not the key, is kept in the cookie).
    dashboard_session_seconds: int = 12 * 3600
    # Proxies whose X-Forwarded-Proto/-For `serve` believes (comma-separated, "*" for any):
    # behind a TLS-terminating proxy the dashboard's cookie is then marked Secure.
    forwarded_allow_ips: str = "127.0.0.1"

    @property
    def embedded(self) -> bool:
        return not self.broker_url

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.home / 'batchwright.sqlite3'}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
