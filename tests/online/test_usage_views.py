"""Where an operator sees online usage: the dashboard's batches page (beside the batches)
and `batchwright projects set/list` for a project's online rate limits."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx

from tests.online.test_admission import usage_rows
from tests.shared.conftest import METRICS, Service


def test_the_dashboard_shows_a_projects_online_usage_beside_its_batches(svc: Service) -> None:
    key = svc.key("team-dash-online")
    other = svc.key("team-dash-other")
    with httpx.Client(base_url=svc.api_url, timeout=30) as web:
        body = {"model": "demo", "prompt": "x", "stream": True}
        for secret in (key, key, other):
            answer = web.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
            )
            assert answer.status_code == 503  # no worker: refused, and still accounted
        svc.wait(lambda: len(usage_rows(svc, "team-dash-online")) == 2, what="2 usage rows")
        assert web.post("/dashboard/login", data={"key": key}).status_code in (200, 303)
        page = web.get("/dashboard/batches", follow_redirects=True)
    assert page.status_code == 200
    assert "Online requests" in page.text
    row = re.search(r'<tr data-model="demo">(.*?)</tr>', page.text, flags=re.S)
    assert row is not None, page.text
    cells = re.findall(r"<td>(.*?)</td>", row.group(1))
    assert cells[:4] == ["demo", "2", "2", "0"]  # the other project's request is not here


def test_projects_set_takes_online_rate_limits(svc: Service) -> None:
    out = svc.cli("projects", "set", "team-limits", "--rpm", "60", "--tpm", "5000")
    assert out.returncode == 0, out.stderr
    rows = svc.sql(
        "SELECT online_requests_per_minute, online_tokens_per_minute FROM projects "
        "WHERE name = 'team-limits'"
    )
    assert rows == [(60, 5000)]
    assert svc.cli("projects", "set", "team-limits", "--rpm", "0").returncode == 0
    rows = svc.sql("SELECT online_requests_per_minute FROM projects WHERE name = 'team-limits'")
    assert rows == [(None,)]


def test_complete_without_a_worker_says_so_in_one_line(svc: Service) -> None:
    key = svc.key("team-cli")
    env = {"OPENAI_BASE_URL": svc.api_url, "OPENAI_API_KEY": key}
    done = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "complete", "Hello", "--model", "demo"],
        env={**svc.env, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: the service answered 503: No worker is serving model 'demo' right now (none "
        "has a live heartbeat); start one (`batchwright worker --models demo`) or retry later."
    ]


def test_metrics_count_online_requests_by_status(svc: Service) -> None:
    key = svc.key("team-metrics")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "demo-b", "prompt": "x", "stream": True}
    series = 'batchwright_online_requests_total{model="demo-b",status="503",stream="true"}'

    def count() -> float:
        text = httpx.get(svc.api_url + "/metrics", headers=METRICS).text
        found = [ln for ln in text.splitlines() if ln.startswith(series + " ")]
        return float(found[0].rsplit(" ", 1)[1]) if found else 0.0

    before = count()
    for _ in range(2):
        answer = httpx.post(svc.api_url + "/v1/completions", json=body, headers=headers)
        assert answer.status_code == 503
    assert count() == before + 2
