"""What an online request gets before any worker sees it: the key first, then the body
(capped), the validation batch lines get (with `stream` and `stream_options` allowed),
the model, a live worker — each a plain JSON error in OpenAI's envelope, never a stream."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.online.conftest import BODY_CAP
from tests.shared.conftest import Service

USAGE = (
    "SELECT r.model, r.status, r.stream, r.error_code, r.prompt_tokens, r.completion_tokens,"
    " r.time_to_first_token, r.duration, r.finish_reasons, r.disconnected, r.key_id"
    " FROM online_requests r JOIN projects p ON p.id = r.project_id"
    " WHERE p.name = %s ORDER BY r.created_at"
)


def usage_rows(svc: Service, project: str) -> list[tuple[object, ...]]:
    return svc.sql(USAGE, project)


def _post(svc: Service, key: str | None, **kwargs: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(svc.api_url + "/v1/completions", headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"stream": True, "best_of": 2}, "best_of", "cannot be streamed"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"stream": True, "stream_options": {"usage": True}}, "stream_options", "unknown option"),
        ({"stream": True, "suffix": "!"}, "suffix", "not supported"),
        ({"stream": True, "logprobs": 6}, "logprobs", "maximum of 5"),
        ({"stream": True, "extra_body": {"frequency": 1}}, "frequency", "Unrecognized request"),
    ],
)
def test_a_bad_request_is_a_json_400_naming_the_parameter_even_when_streamed(
    svc: Service, params: dict[str, object], param: str, words: str
) -> None:
    client = svc.client(svc.key("team-admission"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt="Hello", max_tokens=4, **params)
    assert caught.value.status_code == 400
    assert caught.value.response.headers["content-type"].startswith("application/json")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and words in error["message"], error


def test_a_batch_line_with_stream_is_still_refused(svc: Service) -> None:
    """One code path, two callers: online takes `stream`, a batch line still may not."""
    from batchwright.protocol.completions import check_completion_body

    body = {"model": "demo", "prompt": "x", "stream": True}
    _, error = check_completion_body(body, 8)
    assert error is not None and error["param"] == "stream" and "batch" in error["message"]
    assert check_completion_body(body, 8, online=True)[1] is None


def test_an_unknown_model_is_a_404_and_no_worker_a_503_at_once(svc: Service) -> None:
    client = svc.client(svc.key("team-admission"))
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="Hello", stream=True)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.InternalServerError) as unserved:
        client.completions.create(model="demo", prompt="Hello", stream=True)
    assert unserved.value.status_code == 503
    body = unserved.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_served"
    assert "No worker is serving model 'demo'" in body["message"]


def test_the_key_is_checked_before_the_body_and_the_body_is_capped(svc: Service) -> None:
    key = svc.key("team-admission")
    oversized = b'{"model": "demo", "prompt": "' + b"x" * (BODY_CAP + 10) + b'"}'
    refused = _post(svc, None, content=oversized)
    assert refused.status_code == 401
    assert _post(svc, "sk-bw-wrong", content=b"{not json").status_code == 401
    too_big = _post(svc, key, content=oversized)
    assert too_big.status_code == 413
    assert "request body is over" in too_big.json()["error"]["message"]
    garbled = _post(svc, key, content=b"{not json")
    assert garbled.status_code == 400 and garbled.json()["error"]["code"] == "invalid_json"


def test_refused_requests_leave_usage_rows(svc: Service) -> None:
    key = svc.key("team-usage-refused")
    assert _post(svc, key, json={"model": "demo", "prompt": "x", "n": 0}).status_code == 400
    assert _post(svc, key, json={"model": "demo", "prompt": "x", "stream": True}).status_code == 503
    svc.wait(lambda: len(usage_rows(svc, "team-usage-refused")) == 2, what="2 usage rows")
    rows = [r[:4] for r in usage_rows(svc, "team-usage-refused")]
    assert rows == [("demo", 400, False, None), ("demo", 503, True, "model_not_served")]
