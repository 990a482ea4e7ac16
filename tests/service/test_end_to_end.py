"""The whole service through the official openai SDK: upload, create, poll, download."""

from __future__ import annotations

from typing import Any

from tests.helpers import held_mid_batch, jsonl, line, read_jsonl, submit, wait_batch


def _requests() -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = [
        {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
        {"prompt": ["first prompt", "second prompt"], "max_tokens": 5, "n": 2, "seed": 7},
        {"prompt": [5, 6, 7, 8], "max_tokens": 6, "logprobs": 3, "temperature": 0.7},
        {"prompt": "echo me", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "stop early", "max_tokens": 20, "stop": ["e", "a"], "temperature": 0},
        {"prompt": "best of", "max_tokens": 5, "n": 1, "best_of": 3, "seed": 3},
        {
            "prompt": "penalties",
            "max_tokens": 8,
            "presence_penalty": 1.5,
            "frequency_penalty": 0.5,
            "top_p": 0.9,
        },
    ]
    return [line(f"req-{i}", body) for i, body in enumerate(bodies * 3)]


def test_sdk_round_trip(client: Any) -> None:
    requests = _requests()
    batch = submit(client, jsonl(requests), metadata={"team": "a", "run": "e2e"})
    assert batch.status == "validating"
    assert batch.metadata == {"team": "a", "run": "e2e"}
    assert batch.id.startswith("batch_")

    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.model == "demo"
    assert done.request_counts.total == len(requests)
    assert done.request_counts.completed == len(requests)
    assert done.request_counts.failed == 0
    assert done.error_file_id is None
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, stamp) is not None, stamp

    out = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in requests]
    prompt_sum = completion_sum = 0
    for req, o in zip(requests, out, strict=True):
        assert o["id"].startswith("batch_req_")
        assert o["error"] is None
        resp = o["response"]
        assert resp["status_code"] == 200
        assert resp["request_id"]
        body = resp["body"]
        assert body["id"].startswith("cmpl-")
        assert body["object"] == "text_completion"
        assert body["model"] == "demo"
        assert body["system_fingerprint"]
        prompts = req["body"]["prompt"]
        n_prompts = len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], str) else 1
        n = req["body"].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n_prompts * n))
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
            assert isinstance(choice["text"], str)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        prompt_sum += usage["prompt_tokens"]
        completion_sum += usage["completion_tokens"]
    assert done.usage.input_tokens == prompt_sum
    assert done.usage.output_tokens == completion_sum
    assert done.usage.total_tokens == prompt_sum + completion_sum

    listed = client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]
    outputs = client.files.list(purpose="batch_output")
    assert done.output_file_id in [f.id for f in outputs.data]
    meta = client.files.retrieve(done.output_file_id)
    assert meta.purpose == "batch_output"
    assert meta.bytes == len(client.files.content(done.output_file_id).content)


def test_counts_and_usage_move_while_running(client: Any, pg_url: str) -> None:
    requests = [
        line(f"live-{i}", {"max_tokens": 48, "temperature": 0.9, "seed": i}) for i in range(256)
    ]
    batch = submit(client, jsonl(requests))
    # Looked at while no more result can land once some have (however fast the engine):
    # the batch is part-way, and the API says so.
    with held_mid_batch(pg_url, batch.id) as finished:
        partial = client.batches.retrieve(batch.id)
    assert partial.status == "in_progress"
    counts = partial.request_counts
    assert 0 < counts.completed + counts.failed == finished < counts.total
    done = wait_batch(client, batch.id)
    assert done.status == "completed"
    assert 0 < partial.usage.output_tokens < done.usage.output_tokens


def test_cancel_keeps_partial_output(client: Any) -> None:
    # Enough lines that some are still queued when the cancel lands: a worker holds a claim
    # of up to claim_batch_size lines plus the engine's read-ahead, and those finish.
    requests = [line(f"c-{i}", {"max_tokens": 64}) for i in range(300)]
    batch = submit(client, jsonl(requests))
    wait_running = wait_batch_progress(client, batch.id)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled"
    assert done.cancelling_at and done.cancelled_at
    out = read_jsonl(client, done.output_file_id)
    errs = read_jsonl(client, done.error_file_id)
    ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in errs]
    assert sorted(ids) == sorted(r["custom_id"] for r in requests)
    assert len(out) >= wait_running
    assert any(e["error"] and e["error"]["code"] == "batch_cancelled" for e in errs)
    assert done.request_counts.completed == len(out)
    assert done.request_counts.failed == len(errs)


def wait_batch_progress(client: Any, batch_id: str) -> int:
    import time

    end = time.monotonic() + 120
    while time.monotonic() < end:
        b = client.batches.retrieve(batch_id)
        if b.request_counts.completed > 0:
            return int(b.request_counts.completed)
        time.sleep(0.2)
    raise TimeoutError("no progress")
