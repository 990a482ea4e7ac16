"""Dashboard pages over plain HTTP (no browser): what a signed-in user reads on them."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import create_key
from tests.helpers import jsonl, line, submit, wait_batch


def sign_in(api_url: str, key: str) -> httpx.Client:
    web = httpx.Client(base_url=api_url, timeout=60)
    resp = web.post("/dashboard/login", data={"key": key})
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/batches", resp
    return web


@pytest.fixture
def signed_in(api_url: str, service_env: dict[str, str]) -> Iterator[tuple[httpx.Client, str]]:
    key = create_key(service_env, "dash-pages")
    web = sign_in(api_url, key)
    yield web, key
    web.close()


def _row(html: str, attr: str, value: str) -> str:
    found = re.search(rf'<tr {attr}="{re.escape(value)}"[^>]*>(.*?)</tr>', html, re.S)
    assert found, html
    return found.group(0)


def test_errors_table_shows_the_lines_own_error(
    signed_in: tuple[httpx.Client, str], api_url: str, worker: Any
) -> None:
    web, key = signed_in
    client = OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=0, timeout=60)
    rows = [line("ok"), line("bias", {"logit_bias": {"²": 1}}), line("n0", {"n": 0})]
    done = wait_batch(client, submit(client, jsonl(rows)).id)
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    page = web.get(f"/dashboard/batches/{done.id}").text
    table = page[page.index('<table id="errors">') :]
    table = table[: table.index("</table>")]
    assert "batch_failed" not in table
    bias = table[table.index("bias") :]
    # logit_bias's error has no code: its param and message show instead.
    assert "param <code>logit_bias</code>" in bias.split("</tr>")[0], table
    assert "token ids" in bias.split("</tr>")[0]
    n0 = table[table.index("n0") :].split("</tr>")[0]
    assert "integer_below_min_value" in n0 or "<code>n</code>" in n0, table


def test_workers_page_marks_a_silent_worker_gone(
    signed_in: tuple[httpx.Client, str], service_env: dict[str, str], worker: Any
) -> None:
    """A SIGKILLed worker leaves its last heartbeat row behind (rows in flight, tokens/s);
    once that beat is stale the page says the worker is gone and shows neither."""
    from batchwright.config import get_settings
    from batchwright.db.models import WorkerHeartbeat
    from batchwright.db.session import session_scope

    stale = time.time() - 4 * get_settings().heartbeat_seconds
    with session_scope() as session:
        session.merge(
            WorkerHeartbeat(
                id="killed-host:4242", host="killed-host", pid=4242, models="demo",
                loaded="demo", control=False, rows_in_flight=37, tokens_per_second=812.5,
                lines_completed=900, started_at=stale - 600, last_seen=stale,
            )
        )  # fmt: skip
    web, _ = signed_in
    try:
        page = web.get("/dashboard/service").text
        dead = _row(page, "data-worker", "killed-host:4242")
        assert 'data-state="gone"' in dead and "gone" in dead
        # Its cells, not its last-seen time (whose seconds may well read 37).
        cells = re.findall(r"<td[^>]*>([^<]*)</td>", dead)
        assert "37" not in cells and "812.5" not in cells, dead
        live = re.findall(r'<tr data-worker="[^"]+" data-state="live"', page)
        assert live, page  # the suite's worker, beating
        assert page.index('data-state="live"') < page.index('data-state="gone"')
    finally:
        with session_scope() as session:
            session.execute(
                WorkerHeartbeat.__table__.delete().where(WorkerHeartbeat.id == "killed-host:4242")
            )
