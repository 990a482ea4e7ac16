"""The dashboard in a real headless Chromium (Debian's package, driven by Playwright):
sign in with a key, watch an SDK batch reach completed, download its output, cancel
another batch. Screenshots land in test-artifacts/dashboard/ (ignored by git)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.conftest import CI, create_key
from tests.helpers import jsonl, line, submit, wait_batch

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not CHROMIUM.exists():
        if CI:
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh --user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=FLAGS,
            accept_downloads=True,
            viewport={"width": 1400, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def shots(tmp_path: Path) -> Iterator[Any]:
    folder = tmp_path / "screenshots"
    folder.mkdir()

    def take(page: Any, name: str) -> None:
        page.screenshot(path=str(folder / f"{name}.png"), full_page=True)

    yield take
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copy(png, ARTIFACTS / png.name)


def test_dashboard_end_to_end(
    browser: Any, shots: Any, api_url: str, service_env: dict[str, str], worker: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    key = create_key(service_env, "dashboard")
    client = OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=0, timeout=60)
    page = browser.new_page()

    page.goto(api_url + "/dashboard")
    assert page.url.endswith("/dashboard/login")
    page.fill("#key", "sk-bw-not-a-key")
    page.click("button[type=submit]")
    assert "Incorrect API key" in page.inner_text("#login-error")
    page.fill("#key", key)
    shots(page, "01-login")
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/batches")

    # A batch through the SDK; its page follows it live to completed.
    requests = [line(f"d{i}", {"max_tokens": 24, "seed": i, "temperature": 0.7}) for i in range(24)]
    batch = submit(client, jsonl(requests), metadata={"from": "dashboard-test"})
    page.goto(f"{api_url}/dashboard/batches/{batch.id}")
    shots(page, "02-batch-validating")
    # The page refreshes itself: progress shows while lines land (or it is already done).
    # Selectors, not script: the page's Content-Security-Policy allows no eval.
    page.wait_for_selector(
        "#progress:not([data-done='0']), #status:text-is('completed')", timeout=240_000
    )
    shots(page, "03-batch-in-progress")
    page.wait_for_selector("#status:text-is('completed')", timeout=240_000)
    shots(page, "04-batch-completed")
    assert "24 completed, 0 failed of 24" in page.inner_text("#counts")

    with page.expect_download() as info:
        page.click("#download-output")
    saved = tmp_path / "output.jsonl"
    info.value.save_as(saved)
    expected = client.files.content(wait_batch(client, batch.id).output_file_id).content
    assert saved.read_bytes() == expected
    assert [json.loads(x)["custom_id"] for x in saved.read_text().splitlines()] == [
        r["custom_id"] for r in requests
    ]

    # Another batch, cancelled from its page.
    # Far more work than any engine finishes before the page is open (a 300-line batch
    # sometimes completed first on a quiet machine); cancel stops it within a step.
    many = [line(f"c{i}", {"max_tokens": 256, "seed": i, "temperature": 0.9}) for i in range(3000)]
    other = submit(client, jsonl(many))
    page.goto(api_url + "/dashboard/service")  # its lines wait in the model's queue
    page.wait_for_selector("#queues td:text-is('demo')", timeout=120_000)
    shots(page, "05-service-queue")
    page.goto(f"{api_url}/dashboard/batches/{other.id}")
    page.click("#cancel")
    page.wait_for_url(f"**/dashboard/batches/{other.id}?notice=cancelling")
    assert "Cancelling" in page.inner_text("#notice")
    page.wait_for_selector("#status:text-is('cancelled')", timeout=240_000)
    # The banner went with the status (the page refreshes itself at the same address).
    assert page.locator("#notice").count() == 0
    shots(page, "06-batch-cancelled")
    cancelled = client.batches.retrieve(other.id)
    assert cancelled.status == "cancelled"
    assert "batch_cancelled" in page.inner_text("#errors")

    # A batch that fails validation shows its errors with line numbers.
    bad = wait_batch(client, submit(client, jsonl([line("ok")]) + b"{nope\n").id)
    page.goto(f"{api_url}/dashboard/batches/{bad.id}")
    errors = page.inner_text("#errors")
    assert "invalid_json_line" in errors and "Line 2" in errors
    shots(page, "07-batch-failed")

    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(api_url + "/dashboard/batches")
    # The table fits a 1280 px window (a laptop's): no column off to the right.
    table = page.locator("#batches").bounding_box()
    assert table is not None and 2 * table["x"] + table["width"] <= 1280, table  # margins
    rows = page.locator("#batches tr[data-batch]")
    assert rows.count() == 3
    listed = {r.get_attribute("data-batch"): r.get_attribute("data-status") for r in rows.all()}
    assert listed == {batch.id: "completed", other.id: "cancelled", bad.id: "failed"}
    shots(page, "08-batches")

    page.goto(api_url + "/dashboard/files")
    files_text = page.inner_text("#files")
    assert batch.input_file_id in files_text and "batch_output" in files_text
    shots(page, "09-files")

    # Another project's batch is not visible with this key.
    other_client = OpenAI(
        base_url=api_url + "/v1", api_key=create_key(service_env, "dash-other"), max_retries=0
    )
    foreign = submit(other_client, jsonl([line("x")]))
    resp = page.goto(f"{api_url}/dashboard/batches/{foreign.id}")
    assert resp is not None and resp.status == 404
