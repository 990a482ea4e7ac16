"""Online chat through the official SDK against a real worker: `chat.completions.create`
(answered and streamed as chat.completion.chunk) and `chat.completions.parse` with a
pydantic model as the response_format."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tests.online.worker.test_worker_engine import _live, _worker
from tests.shared.conftest import Service

MESSAGES: Any = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Is the sea blue?"},
]


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    confidence: int = Field(ge=0, le=9)


def test_chat_create_streamed_and_not(svc: Service) -> None:
    _worker(svc)
    client = svc.client(svc.key("team-chat"))
    svc.wait(lambda: _live(svc), what="a live worker")
    body: dict[str, Any] = {
        "model": "demo",
        "messages": MESSAGES,
        "max_completion_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
    }
    plain = client.chat.completions.create(**body)
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        streamed = [e.token for c in mine if c.logprobs for e in c.logprobs.content or []]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert streamed == [e.token for e in choice.logprobs.content]
        assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.total_tokens == plain.usage.total_tokens


def test_chat_parse_with_a_pydantic_model(svc: Service) -> None:
    _worker(svc)
    client = svc.client(svc.key("team-chat"))
    svc.wait(lambda: _live(svc), what="a live worker")
    done = client.chat.completions.parse(
        model="demo",
        messages=MESSAGES,
        response_format=Verdict,
        max_completion_tokens=40,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content or "") == choice.message.parsed
