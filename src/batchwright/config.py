"""Typed settings: one class, env prefix BATCHWRIGHT_."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> Path:
    return Path.home() / ".cache" / "batchwright"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHWRIGHT_", env_file=".env", extra="ignore")

    # Empty database URL means the embedded default: SQLite under `home`.
    database_url: str = ""
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
    max_attempts: int = 3
    # A process task gives the queue back after this long so control tasks
    # (validate, finalize) never wait behind a long generation run.
    work_slice_seconds: float = 60.0
    sweep_interval_seconds: float = 15.0

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
