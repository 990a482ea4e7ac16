"""Per-project quotas on enqueued lines and tokens, set from the CLI."""

from __future__ import annotations

import os

from tests.helpers import jsonl, line, submit, wait_batch
from tests.shared.conftest import Service


def test_enqueued_token_and_line_limits(svc: Service, no_torch: str) -> None:
    path = os.pathsep.join([no_torch, os.environ.get("PYTHONPATH", "")])
    svc.spawn("control", ["worker", "--control-only"], PYTHONPATH=path).wait_for("ready.")
    out = svc.cli("projects", "set", "team-q", "--max-enqueued-tokens", "100")
    assert out.returncode == 0, out.stderr
    client = svc.client(svc.key("team-q"))

    # 5 lines x max_tokens 30: at least 150 tokens against a limit of 100.
    over = submit(client, jsonl([line(f"t{i}", {"max_tokens": 30}) for i in range(5)]))
    final = wait_batch(client, over.id)
    assert final.status == "failed"
    error = final.errors.data[0]
    assert error.code == "token_limit_exceeded"
    assert "limit 100 tokens" in error.message and "team-q" in error.message

    out = svc.cli(
        "projects", "set", "team-q", "--max-enqueued-tokens", "0", "--max-enqueued-lines", "6"
    )
    assert out.returncode == 0, out.stderr
    assert "team-q" in out.stdout
    # No worker serves `demo-b` here: the first batch stays in progress, enqueued.
    first = submit(client, jsonl([line(f"l{i}", {"model": "demo-b"}) for i in range(4)]))
    svc.wait(lambda: client.batches.retrieve(first.id).status == "in_progress", 60, "validated")
    second = submit(client, jsonl([line(f"m{i}", {"model": "demo-b"}) for i in range(3)]))
    final = wait_batch(client, second.id)
    assert final.status == "failed"
    error = final.errors.data[0]
    assert error.code == "token_limit_exceeded"
    assert "limit 6 lines" in error.message and "4 already enqueued" in error.message
    # Within the limit, a batch passes.
    third = submit(client, jsonl([line("n0", {"model": "demo-b"})]))
    svc.wait(lambda: client.batches.retrieve(third.id).status == "in_progress", 60, "validated")
    for batch in (first, third):
        client.batches.cancel(batch.id)
        assert wait_batch(client, batch.id).status == "cancelled"


def test_a_limit_past_bigint_is_a_usage_error() -> None:
    """Refused before the database is touched (it raised `bigint out of range`)."""
    from typer.testing import CliRunner

    from batchwright.cli import app

    for option in ("--max-enqueued-lines", "--max-enqueued-tokens", "--rpm", "--tpm"):
        out = CliRunner().invoke(app, ["projects", "set", "team-x", option, str(2**63)])
        assert out.exit_code == 2, (option, out.output)
        assert "9223372036854775807" in out.output, out.output
