"""POST /v1/chat/completions before any worker sees it: the same admission as
/v1/completions (plain JSON 400s naming the parameter, even for a streamed request; 404
for an unknown model, 503 at once without a live worker), through the official SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.shared.conftest import Service

MESSAGES: Any = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
        ({"tool_choice": "auto"}, "tool_choice", "not supported"),
        ({"modalities": ["audio"]}, "modalities", "not supported"),
        (
            {"stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when",
        ),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "maximum of 20"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x y"}}},
            "response_format",
            "a-z, A-Z",
        ),
    ],
)
def test_a_bad_chat_request_is_a_json_400_naming_the_parameter(
    svc: Service, params: dict[str, Any], param: str, words: str
) -> None:
    client = svc.client(svc.key("team-chat"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="demo", messages=MESSAGES, **{"stream": True, **params}
        )
    assert caught.value.response.headers["content-type"].startswith("application/json")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and words in error["message"], error


def test_an_image_part_is_named_as_unsupported(svc: Service) -> None:
    client = svc.client(svc.key("team-chat"))
    image: Any = [{"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": image}])
    assert caught.value.body["param"] == "messages[0].content[0].type"  # type: ignore[index]


def test_no_worker_is_a_503_at_once(svc: Service) -> None:
    client = svc.client(svc.key("team-chat"))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.InternalServerError) as unserved:
        client.chat.completions.create(model="demo", messages=MESSAGES, stream=True)
    assert unserved.value.status_code == 503
    assert unserved.value.body["code"] == "model_not_served"  # type: ignore[index]
