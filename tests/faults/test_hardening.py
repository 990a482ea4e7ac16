"""Hardening, round 2 (issue 9): outage edges, bounded re-drives, bounded memory, cancel."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import _free_port
from tests.faults.checks import assert_batch_whole
from tests.faults.conftest import Stack
from tests.faults.fakes import FakeEngine, provider
from tests.faults.test_workers import _lines
from tests.helpers import TERMINAL, jsonl, line, submit, wait_batch


def test_writes_committed_with_the_broker_down_answer_200(fault: Stack) -> None:
    """The commit is the truth: a failed wake-up is left to the sweeper, not a 500."""
    _, url = fault.api(BATCHWRIGHT_BROKER_URL=f"redis://127.0.0.1:{_free_port()}/0")
    down = fault.client(url)
    requests = _lines("nobroker", 6, 4)
    batch = submit(down, jsonl(requests))  # POST /v1/batches: its send fails after commit
    assert batch.status == "validating"
    other = submit(down, jsonl(_lines("nobroker-c", 4, 4)))
    cancelled = down.batches.cancel(other.id)
    assert cancelled.status == "cancelling"
    assert len([b for b in down.batches.list(limit=100).data if b.id == batch.id]) == 1

    fault.worker()  # the sweeper (on the working broker) re-sends what was never sent
    done = assert_batch_whole(fault, fault.client(), batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert wait_batch(fault.client(), other.id, timeout=120).status == "cancelled"


def _validated(fault: Stack, prefix: str, n: int = 6) -> tuple[Any, list[dict[str, Any]]]:
    from batchwright import control

    requests = _lines(prefix, n, 4)
    batch = submit(fault.client(), jsonl(requests))
    control.validate_batch(batch.id)
    return batch, requests


def test_validation_that_keeps_raising_ends_failed(
    fault: Stack, in_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever validation raises, the batch ends within a bounded number of re-drives
    with an error saying what happened (it used to stay `validating` for its window)."""
    from batchwright import control
    from batchwright.batches import lifecycle
    from batchwright.config import get_settings

    client = fault.client()
    batch = submit(client, jsonl(_lines("redrive-v", 3, 4)))

    def explode(*_: Any, **__: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(lifecycle, "scan_input", explode)
    bound = get_settings().max_batch_failures
    for _ in range(bound):  # what the sweeper's re-sends do, one interval after another
        assert client.batches.retrieve(batch.id).status == "validating"
        with pytest.raises(RecursionError):
            control.validate_batch(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "failed", done
    assert done.errors is not None
    [err] = done.errors.data
    assert err.code == "validation_failed"
    assert "RecursionError" in (err.message or "") and f"{bound} times" in (err.message or "")
    control.validate_batch(batch.id)  # a late re-send is a no-op on a terminal batch
    assert client.batches.retrieve(batch.id).status == "failed"


def test_finalize_that_keeps_raising_ends_failed(
    fault: Stack, in_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchwright import control
    from batchwright.batches import output
    from batchwright.worker.generation import runner

    client = fault.client()
    batch, _ = _validated(fault, "redrive-f")
    # Lines left queued by other tests' batches may run too: only this batch's count matters.
    runner.process("demo", engine_provider=provider(FakeEngine(delay=0.0)))
    assert client.batches.retrieve(batch.id).request_counts.completed == 6

    def broken(*_: Any, **__: Any) -> None:
        raise ValueError("output storage refused the file")

    monkeypatch.setattr(output, "render", broken)
    for _ in range(10):
        if client.batches.retrieve(batch.id).status in TERMINAL:
            break
        with pytest.raises(ValueError):
            control.finalize_batch(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "failed", done
    assert done.errors is not None
    assert done.errors.data[0].code == "finalization_failed"
    assert "output storage refused" in (done.errors.data[0].message or "")
    assert done.request_counts.completed == 6  # the lines that ran are still counted


class PeakRSS:
    """Samples a process's resident memory every few milliseconds, keeps the maximum."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak = psutil.Process(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_api_memory_stays_bounded_for_streamed_bodies(fault: Stack) -> None:
    """Chunked multipart bodies (no Content-Length): many small fields, a preamble and a
    big file each keep the API under 300 MiB, during the request and after it."""
    # The 120 MB file must fit the limit whatever the suite exported (16 MB for its API).
    proc, url = fault.api(BATCHWRIGHT_MAX_UPLOAD_BYTES=str(200 * 1024 * 1024))
    headers = {
        "Authorization": f"Bearer {fault.api_key}",
        "content-type": "multipart/form-data; boundary=b",
    }

    def fields() -> Iterator[bytes]:
        for i in range(400_000):  # 400 MB of 1 KB fields
            yield b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\n' % i
            yield b"x" * 1000 + b"\r\n"
        yield b"--b--\r\n"

    def big_file() -> Iterator[bytes]:
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        row = jsonl([line("x" * 40)])
        block = row * (1024 * 1024 // len(row))
        for _ in range(120):  # about 120 MB
            yield block
        yield b"\r\n--b--\r\n"

    peaks = {}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
        for name, body, ok in (("fields", fields, (400,)), ("file", big_file, (200,))):
            with PeakRSS(proc.popen.pid) as rss:
                try:
                    status = http.post("/v1/files", content=body()).status_code
                except httpx.TransportError:
                    status = 400  # refused mid-stream: the server closed while we wrote
            assert status in ok, (name, status)
            peaks[name] = rss.peak / 2**20
    after = psutil.Process(proc.popen.pid).memory_info().rss / 2**20
    print(f"api rss: peaks {peaks} MiB, after {after:.0f} MiB")
    assert max(peaks.values()) < 300, peaks
    assert after < 300, after


def _eos(fault: Stack) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(fault.env["BATCHWRIGHT_HOME"]) / "models" / "demo")
    return int(tok.eos_token_id)


def test_cancel_stops_lines_a_worker_holds(fault: Stack) -> None:
    """Lines already held stop at the engine's next step; the batch is `cancelled` without
    waiting for them to finish (they used to run to the end first)."""
    client = fault.client()
    fault.worker(BATCHWRIGHT_CANCEL_POLL_SECONDS="0.5")
    body = {"max_tokens": 400, "n": 8, "temperature": 0.8, "logit_bias": {str(_eos(fault)): -100}}
    requests = [line(f"long-{i}", {**body, "seed": i}) for i in range(24)]
    batch = submit(client, jsonl(requests))
    query = "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = %s"
    end = time.monotonic() + 120
    while not fault.scalar(query, batch.id, "running"):  # a worker holds lines now
        assert time.monotonic() < end, "no line was ever held"
        time.sleep(0.05)
    held = int(fault.scalar(query, batch.id, "running"))
    client.batches.cancel(batch.id)
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "cancelled"
    finished = int(fault.scalar(query, batch.id, "succeeded"))
    print(f"cancel: {held} lines held at the cancel, {finished} of them ran to the end")
    assert finished < held, (finished, held)
