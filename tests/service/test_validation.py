"""File-level validation fails the batch with line numbers; a bad body is a per-line 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch


def _fails_with(client: Any, data: bytes, code: str, line_no: int | None) -> Any:
    batch = wait_batch(client, submit(client, data).id)
    assert batch.status == "failed", batch
    assert batch.failed_at is not None
    codes = [(e.code, e.line) for e in batch.errors.data]
    assert (code, line_no) in codes if line_no is not None else code in [c for c, _ in codes]
    return batch


def test_not_json(client: Any) -> None:
    data = jsonl([line("a")]) + b"{not json\n" + jsonl([line("c")])
    batch = _fails_with(client, data, "invalid_json_line", 2)
    assert "Line 2" in batch.errors.data[0].message


def test_missing_custom_id(client: Any) -> None:
    bad = line("x")
    del bad["custom_id"]
    _fails_with(client, jsonl([line("a"), bad]), "missing_custom_id", 2)


def test_duplicate_custom_id(client: Any) -> None:
    _fails_with(client, jsonl([line("a"), line("b"), line("a")]), "duplicate_custom_id", 3)


def test_method_not_post(client: Any) -> None:
    _fails_with(client, jsonl([line("a"), line("b", method="GET")]), "invalid_method", 2)


def test_wrong_url(client: Any) -> None:
    _fails_with(client, jsonl([line("a", url="/v1/responses")]), "invalid_url", 1)
    # An embeddings line in a /v1/completions batch: another endpoint of ours.
    _fails_with(client, jsonl([line("a", url="/v1/embeddings")]), "url_mismatch", 1)
    # A chat line in a /v1/completions batch: OpenAI's url_mismatch.
    _fails_with(
        client, jsonl([line("a"), line("b", url="/v1/chat/completions")]), "url_mismatch", 2
    )


def test_unknown_model(client: Any) -> None:
    _fails_with(client, jsonl([line("a", {"model": "gpt-9"})]), "model_not_found", 1)


def test_mismatched_model(client: Any) -> None:
    # The suite's registry has two names ("demo", "demo-b"): both known, not mixable.
    _fails_with(client, jsonl([line("a"), line("b", {"model": "demo-b"})]), "mismatched_model", 2)


def test_empty_file(client: Any) -> None:
    # A 0-byte upload is refused at upload (test_api_details); blank lines fail validation.
    _fails_with(client, b"\n\n  \n", "empty_file", 0)


def test_too_many_tasks(client: Any, service_env: dict[str, str]) -> None:
    # The limit is 50,000 lines; the suite runs the API and workers with the default.
    data = b"".join(
        b'{"custom_id":"r%d","method":"POST","url":"/v1/completions",'
        b'"body":{"model":"demo","prompt":"x"}}\n' % i
        for i in range(50_001)
    )
    _fails_with(client, data, "too_many_tasks", 50_001)


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        ({"temperature": 5}, "temperature", "temperature"),
        ({"n": 0}, "n", "n"),
        ({"n": 3, "best_of": 2}, "best_of", "best_of"),
        ({"suffix": "x"}, "suffix", "suffix"),
        ({"stream": True}, "stream", "stream"),
        ({"logprobs": 9}, "logprobs", "logprobs"),
        ({"unknown_field": 1}, "unknown_field", "unknown_field"),
        ({"max_tokens": 10_000_000}, "max_tokens", "10000000"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens"),
        ({"prompt": 12.5}, "prompt", "prompt"),
        ({"logit_bias": {"5": 300}}, "logit_bias", "logit_bias"),
    ],
)
def test_bad_body_is_a_per_line_400(
    client: Any, body: dict[str, Any], param: str, said: str
) -> None:
    requests = [line("good-1"), line("bad", body), line("good-2")]
    batch = wait_batch(client, submit(client, jsonl(requests)).id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 3
    assert batch.request_counts.completed == 2
    assert batch.request_counts.failed == 1
    out = read_jsonl(client, batch.output_file_id)
    errs = read_jsonl(client, batch.error_file_id)
    assert [o["custom_id"] for o in out] == ["good-1", "good-2"]
    assert len(errs) == 1
    err = errs[0]
    assert err["custom_id"] == "bad"
    assert err["response"]["status_code"] == 400
    error = err["response"]["body"]["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert said in error["message"], error


def test_prompt_too_long_names_both_numbers(client: Any) -> None:
    long_prompt = list(range(10, 500))  # token ids; the demo context is 512
    requests = [line("ok"), line("long", {"prompt": long_prompt, "max_tokens": 100})]
    batch = wait_batch(client, submit(client, jsonl(requests)).id)
    assert batch.status == "completed"
    errs = read_jsonl(client, batch.error_file_id)
    assert len(errs) == 1
    error = errs[0]["response"]["body"]["error"]
    assert errs[0]["response"]["status_code"] == 400
    assert "490" in error["message"] and "100" in error["message"], error


def test_every_line_rejected_still_completes(client: Any) -> None:
    requests = [line("a", {"temperature": 9}), line("b", {"top_p": 2})]
    batch = wait_batch(client, submit(client, jsonl(requests)).id)
    assert batch.status == "completed"
    assert batch.output_file_id is None
    assert [e["custom_id"] for e in read_jsonl(client, batch.error_file_id)] == ["a", "b"]
    assert json.loads(json.dumps(batch.request_counts.model_dump())) == {
        "total": 2,
        "completed": 0,
        "failed": 2,
    }
