"""API details OpenAI's clients rely on: models.retrieve, error codes, empty uploads."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI


def test_models_retrieve(client: OpenAI) -> None:
    model = client.models.retrieve("demo")
    assert (model.id, model.object) == ("demo", "model")
    with pytest.raises(NotFoundError) as info:
        client.models.retrieve("gpt-9")
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


def test_json_syntax_error_has_no_param(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/batches", content=b'{"input_file_id": ', headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is None and error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


def test_empty_upload_is_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.files.create(file=("empty.jsonl", b""), purpose="batch")
    body = info.value.body
    assert isinstance(body, dict)
    assert (body["param"], body["code"]) == ("file", "empty_file")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"endpoint": "/v1/completions", "completion_window": "24h"}, "input_file_id",
         "missing_required_parameter"),
        ({"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
          "colour": "red"}, "colour", "unknown_parameter"),
        ({"input_file_id": 5, "endpoint": "/v1/completions", "completion_window": "24h"},
         "input_file_id", "invalid_type"),
    ],
)  # fmt: skip
def test_openai_error_codes(http: httpx.Client, body: object, param: str, code: str) -> None:
    resp = http.post("/v1/batches", json=body)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)


def test_upload_missing_fields_codes(http: httpx.Client) -> None:
    resp = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")})
    assert resp.status_code == 400
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (
        "purpose",
        "missing_required_parameter",
    )
    resp = http.post("/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"1")})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "missing_required_parameter"
