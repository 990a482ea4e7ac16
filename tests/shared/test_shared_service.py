"""End to end: 2 models x 2 workers (each started with one model) x 2 projects, plus a
control-only worker that cannot import torch at all."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import _free_port
from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch
from tests.shared.conftest import METRICS, Service

A_LINES = 1000  # long enough that A is still running when B starts
B_LINES = 20


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def value(text: str, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples(text) if n == name and labels.items() <= lab.items())


def lines(prefix: str, n: int, model: str, max_tokens: int = 8) -> bytes:
    return jsonl(
        [
            line(f"{prefix}-{i}", {"model": model, "max_tokens": max_tokens, "temperature": 0})
            for i in range(n)
        ]
    )


def done(svc: Service, batch_id: str) -> int:
    return int(
        svc.sql(
            "SELECT count(*) FROM batch_requests WHERE batch_id = %s "
            "AND state IN ('succeeded', 'failed')",
            batch_id,
        )[0][0]
    )


def _a_while_b_runs(svc: Service, a: str, b: str) -> tuple[int, int]:
    """A's finished lines when B started and when B's last line landed, sampled back to
    back on one connection (every few milliseconds)."""
    query = (
        "SELECT (SELECT status FROM batches WHERE id = %(b)s), "
        "(SELECT count(*) FROM batch_requests WHERE batch_id = %(a)s "
        "AND state IN ('succeeded', 'failed')), "
        "(SELECT count(*) FROM batch_requests WHERE batch_id = %(b)s "
        "AND state IN ('succeeded', 'failed'))"
    )
    start: int | None = None
    end = time.monotonic() + 900
    with psycopg.connect(svc.pg_url, autocommit=True) as conn:
        while time.monotonic() < end:
            status, a_done, b_done = conn.execute(query, {"a": a, "b": b}).fetchone() or ()
            if start is None and status != "validating":
                start = a_done
            if start is not None and b_done == B_LINES:
                return start, a_done
            time.sleep(0.002)
    raise TimeoutError("B's lines")


# Three workers and 1,080 lines on the demo model: on a loaded two-core machine this takes
# longer than the suite's default per-test limit.
@pytest.mark.timeout(1800)
def test_two_models_two_workers_two_projects(svc: Service, no_torch: str) -> None:
    path = os.pathsep.join([no_torch, os.environ.get("PYTHONPATH", "")])
    control = svc.spawn("control", ["worker", "--control-only"], PYTHONPATH=path)
    ports = {"demo": _free_port(), "demo-b": _free_port()}
    gen = {
        model: svc.spawn(
            f"worker-{model}",
            # Control work is the control-only worker's (as in the compose file).
            ["worker", "--models", model, "--no-control"],
            BATCHWRIGHT_WORKER_METRICS_PORT=str(port),
        )
        for model, port in ports.items()
    }
    for proc in (control, *gen.values()):
        proc.wait_for("ready.")
    team_a, team_b = svc.client(svc.key("team-a")), svc.client(svc.key("team-b"))

    # Capacity: every model has one live worker, in /v1/models and /readyz.
    def live() -> dict[str, Any]:
        # The two models (a module before this one may have added adapters of them).
        return {m.id: m.live_workers for m in team_a.models.list().data if m.id in ports}

    svc.wait(lambda: live() == {"demo": 1, "demo-b": 1}, 60, "heartbeats of both workers")
    ready = httpx.get(svc.api_url + "/readyz", headers=METRICS).json()
    assert {m: ready["models"].get(m) for m in ports} == {"demo": 1, "demo-b": 1}

    # Project A's big batch on `demo`; project B's small one arrives once A is running.
    # 32 tokens a line: the wall-clock latency of B's start (a NOTIFY, a claim, the hop to
    # the engine) costs A a quarter of the lines it would at 8; the bound is in lines.
    big = submit(team_a, lines("a", A_LINES, "demo", 32))
    svc.wait(lambda: done(svc, big.id) >= 50, 900, "A under way")
    small = submit(team_b, lines("b", B_LINES, "demo", 32))
    # Counted from B's start (its validation done), not its upload: at the engine's speed A
    # finishes a line a millisecond, so the upload and validation alone are worth hundreds.
    a_at_submit, a_at_finish = _a_while_b_runs(svc, big.id, small.id)
    # Both projects on `demo-b` meanwhile: the other worker takes them.
    others = [
        submit(team_a, lines("a2", 30, "demo-b")),
        submit(team_b, lines("b2", 30, "demo-b")),
    ]

    # Fair share, counted in work rather than seconds: oldest-first would finish B only
    # after A's every line. With fair share B's 20 lines wait at most for what the worker
    # already holds (claims read ahead plus the engine's window, about 3 x 16 rows) and then
    # take half the rows; A finishes at most 150 lines meanwhile (B alone: 20 lines).
    print(f"fair share: A finished {a_at_finish - a_at_submit} lines while B's {B_LINES} ran")
    assert a_at_finish - a_at_submit <= 150, (a_at_submit, a_at_finish)
    assert a_at_finish < A_LINES

    expected = [(big, team_a, A_LINES), (small, team_b, B_LINES)]
    expected += [(others[0], team_a, 30), (others[1], team_b, 30)]
    for batch, client, n in expected:
        final = wait_batch(client, batch.id, timeout=600)
        assert final.status == "completed", final
        assert final.request_counts.completed == n
        ids = [row["custom_id"] for row in read_jsonl(client, final.output_file_id)]
        assert len(ids) == len(set(ids)) == n

    # Each worker loaded only its own model (heartbeat and its metrics); the control-only
    # worker loaded none and never had torch.
    def loaded() -> dict[str, str]:
        rows = svc.sql("SELECT models, loaded FROM worker_heartbeats")
        return {models: loaded for models, loaded in rows}

    # A heartbeat says what loaded at its next beat after the load: wait for that beat.
    svc.wait(lambda: loaded().get("demo-b") == "demo-b", 60, "demo-b's worker's heartbeat")
    svc.wait(lambda: loaded().get("demo") == "demo", 60, "demo's worker's heartbeat")
    assert loaded()[""] == ""
    for model, port in ports.items():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        other = "demo-b" if model == "demo" else "demo"
        assert value(text, "batchwright_worker_model_loaded", model=model) == 1
        assert not [s for s in samples(text) if s[1].get("model") == other]
        finished = value(text, "batchwright_worker_lines_total", model=model, outcome="completed")
        assert finished == (A_LINES + B_LINES if model == "demo" else 60)
        assert value(text, "batchwright_worker_generated_tokens_total", model=model) > 0
        assert value(text, "batchwright_worker_engine_step_seconds_count", model=model) > 0
        # Every line handed to the engine came back; the writes ran in the lease process,
        # and their timings reached the metrics this worker serves.
        assert value(text, "batchwright_worker_rows_in_flight", model=model) == 0
        assert value(text, "batchwright_worker_result_write_seconds_count") > 0
    assert "succeeded" in control.output() and "validate_batch" in control.output()

    # The API's metrics: requests by route template, batches by status, live workers.
    text = httpx.get(svc.api_url + "/metrics", headers=METRICS).text
    assert value(text, "batchwright_http_requests_total", route="/v1/batches/{batch_id}") > 0
    assert value(text, "batchwright_batches", status="completed") >= 4
    assert value(text, "batchwright_workers_live", model="demo") == 1
    assert value(text, "batchwright_lines", model="demo", state="queued") == 0
