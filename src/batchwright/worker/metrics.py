"""A worker's Prometheus metrics (served on BATCHWRIGHT_WORKER_METRICS_PORT).

One process per worker (solo pool), so the default registry is the process's own; no
multiprocess mode is needed. Names follow prometheus-client conventions (_total, _seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from batchwright.engine.requests.observer import Observer
from batchwright.engine.requests.types import GenResult
from batchwright.worker.stats import STATS

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine

LINES = Counter("batchwright_worker_lines_total", "Lines finished", ["model", "outcome"])
PROMPT_TOKENS = Counter("batchwright_worker_prompt_tokens_total", "Prompt tokens", ["model"])
GENERATED_TOKENS = Counter(
    "batchwright_worker_generated_tokens_total", "Generated tokens", ["model"]
)
STEP_SECONDS = Histogram(
    "batchwright_worker_engine_step_seconds",
    "Model forward of one engine step (decode rows plus any prefill)",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
PREFILL_TOKENS = Histogram(
    "batchwright_worker_prefill_tokens_per_step",
    "Prompt tokens prefilled in one engine step",
    ["model"],
    buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
)
IN_FLIGHT = Gauge("batchwright_worker_rows_in_flight", "Lines handed to the engine", ["model"])
LOADED = Gauge("batchwright_worker_model_loaded", "1 once the model is loaded here", ["model"])
LEASE_RENEWALS = Counter("batchwright_worker_lease_renewals_total", "Lease renewals")
LEASE_EXPIRIES = Counter(
    "batchwright_worker_lease_expiries_total",
    "Results dropped because the lease no longer held the line",
)
RETRIES = Counter("batchwright_worker_task_retries_total", "Celery task retries", ["task"])
OOM_HALVINGS = Counter(
    "batchwright_worker_oom_halvings_total", "Out-of-memory halvings of max_rows", ["model"]
)
# Online requests (worker/generation/pump.py): they count in rows_in_flight and lines too.
ONLINE_IN_FLIGHT = Gauge(
    "batchwright_worker_online_in_flight", "Online requests in the engine", ["model"]
)
ONLINE_ROWS = Gauge("batchwright_worker_online_rows", "Rows held by online requests", ["model"])
ONLINE_CANCELLED = Counter(
    "batchwright_worker_online_cancelled_total",
    "Online requests dropped from the engine because the API gave them up (client gone)",
    ["model"],
)
PREEMPTIONS = Counter(
    "batchwright_worker_preemptions_total",
    "Batch lines that gave their rows to online requests (run again from their prompts)",
    ["model"],
)
RESULT_WRITE_SECONDS = Histogram(
    "batchwright_worker_result_write_seconds", "One result flush to the database"
)


def handed(model: str, n: int) -> None:
    IN_FLIGHT.labels(model).inc(n)
    STATS.add(in_flight=n)


def finished(model: str, results: Sequence[GenResult]) -> None:
    # Lines and tokens by the name each result answers for (a LoRA adapter's own).
    by_name: dict[str, list[GenResult]] = {}
    for r in results:
        name = r.completion.get("model") if r.completion else None
        by_name.setdefault(name if isinstance(name, str) else model, []).append(r)
    for name, rs in by_name.items():
        ok = sum(1 for r in rs if r.status_code == 200)
        LINES.labels(name, "completed").inc(ok)
        LINES.labels(name, "failed").inc(len(rs) - ok)
        PROMPT_TOKENS.labels(name).inc(sum(r.prompt_tokens for r in rs))
        GENERATED_TOKENS.labels(name).inc(sum(r.completion_tokens for r in rs))
    generated = sum(r.completion_tokens for r in results)
    # Embedding results generate nothing: their work is the tokens embedded.
    embedded = sum(
        r.prompt_tokens for r in results if r.completion and r.completion.get("object") == "list"
    )
    IN_FLIGHT.labels(model).dec(len(results))
    STATS.add(in_flight=-len(results), lines=len(results), tokens=generated + embedded)


def released(model: str, n: int) -> None:
    """Lines handed to the engine that came back without a result (a run stopped early)."""
    IN_FLIGHT.labels(model).dec(n)
    STATS.add(in_flight=-n)


def loaded(model: str) -> None:
    LOADED.labels(model).set(1)
    with STATS.lock:
        STATS.loaded.add(model)


class _Timing(Observer):
    """The engine's model forwards (the step's dominant cost), timed as it reports them."""

    def __init__(self, model: str) -> None:
        self.step = STEP_SECONDS.labels(model)
        self.prefill = PREFILL_TOKENS.labels(model)

    def forward(self, seconds: float, prompt_tokens: int) -> None:
        self.step.observe(seconds)
        self.prefill.observe(prompt_tokens)


def instrument(engine: Engine, model: str) -> None:
    """Time the engine's model forwards without touching it (an observer; an embedding
    model's runner, worker/generation/embedding.py, takes one the same way)."""
    if not any(isinstance(o, _Timing) for o in engine.observers):
        engine.observe(_Timing(model))
