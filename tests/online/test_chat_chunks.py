"""A streamed chat request's events as `chat.completion.chunk`s, read with the official
SDK's models: the role first, content deltas, one finish_reason per choice, the usage
chunk, [DONE]; the chunks add up to the non-streamed chat completion."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from batchwright.online.chat_chunks import ChatChunkWriter, token_bytes
from batchwright.relay.messages import ChoiceDelta, Delta, DeltaLogprobs, OnlineRequest


def _request(**body: Any) -> OnlineRequest:
    return OnlineRequest(
        id="cmpl-abc",
        model="demo",
        project_id="p",
        body={"model": "demo", "messages": [{"role": "user", "content": "hi"}], **body},
        created=1,
        enqueued_at=0.0,
        deadline=1e12,
    )


def _events(raw: list[bytes]) -> list[Any]:
    text = b"".join(raw).decode()
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _completion(contents: list[str], logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1,
        "model": "demo",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c},
                "finish_reason": "length" if i else "stop",
                "logprobs": None if logprobs is None else {"content": logprobs[i]},
            }
            for i, c in enumerate(contents)
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


def test_chunks_add_up_to_the_completion() -> None:
    writer = ChatChunkWriter(
        _request(n=2, stream=True), include_usage=True, system_fingerprint="fp"
    )
    out = writer.delta(Delta(worker="w", choices=[ChoiceDelta(index=0, text="Hel", token_ids=[1])]))
    out += writer.delta(
        Delta(
            worker="w",
            choices=[
                ChoiceDelta(index=0, text="lo", token_ids=[2], finish_reason="stop"),
                ChoiceDelta(index=1, text="Bye", token_ids=[3]),
            ],
        )
    )
    # Choice 1 never got its finish delta: the Done completes it.
    out += writer.done(_completion(["Hello", "Bye now"]))
    chunks = [ChatCompletionChunk.model_validate(c) for c in _events(out)]
    assert all(c.id == "chatcmpl-abc" and c.object == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 8
    for index, full, reason in [(0, "Hello", "stop"), (1, "Bye now", "length")]:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == full
        assert [c.finish_reason for c in mine if c.finish_reason] == [reason]
        assert mine[-1].finish_reason == reason
    assert all(c.usage is None for c in chunks[:-1])


def test_chunk_logprobs_are_in_the_chat_shape() -> None:
    writer = ChatChunkWriter(
        _request(stream=True, logprobs=True, top_logprobs=1), include_usage=False
    )
    lp = DeltaLogprobs(
        tokens=["Hi", "bytes:\\xe2\\x82"],
        token_logprobs=[-0.5, -1.0],
        top_logprobs=[{"Hi": -0.5, "Yo": -0.7}, {"bytes:\\xe2\\x82": -1.0}],
        text_offset=[0, 2],
    )
    out = writer.delta(
        Delta(worker="w", choices=[ChoiceDelta(index=0, text="Hi", token_ids=[5, 6], logprobs=lp)])
    )
    entry = {"token": "!", "logprob": -0.1, "bytes": [33], "top_logprobs": []}
    out += writer.done(_completion(["Hi!"], [[{}, {}, entry]]))
    chunks = [ChatCompletionChunk.model_validate(c) for c in _events(out)]
    content = [
        e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in content] == ["Hi", "bytes:\\xe2\\x82", "!"]
    assert content[1].bytes == [0xE2, 0x82] == token_bytes("bytes:\\xe2\\x82")
    assert [t.token for t in content[0].top_logprobs] == ["Hi"]  # top_logprobs=1
    # The non-streamed answer has the same shape the SDK reads.
    ChatCompletion.model_validate(_completion(["Hi!"], [[entry]]))
