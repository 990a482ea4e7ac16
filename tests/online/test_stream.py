"""The endpoint through the official SDK against the real API, Redis and a worker: the
chunk contract, streamed against non-streamed (text, usage, logprobs), echo scoring as
lm-evaluation-harness's `local-completions` asks for it, and the answer of a batch line
with the same body."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.online.e2e import Worker, assemble, events, parse, sse, start_worker
from tests.shared.conftest import Service

PROMPTS = ["Once upon a time", "The quick brown fox"]


@pytest.fixture(scope="module")
def worker(service: Service) -> Iterator[Worker]:
    got = start_worker(service, "demo")
    yield got
    got.proc.stop()


@pytest.fixture(scope="module")
def key(service: Service) -> str:
    return service.key("team-stream")


def test_the_chunk_contract(service: Service, worker: Worker, key: str) -> None:
    body = {
        "model": "demo",
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with sse(service, key, body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = parse(events(response))
    *choice_chunks, usage_chunk = chunks
    # Every chunk: the same id, created and model; one choice; usage null until the last.
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "demo", "text_completion")
    }
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in choice_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in choice_chunks:
        choice = chunk["choices"][0]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]  # prompt_index * n + j
    for choices in by_index.values():
        *texts, finish = choices
        # Exactly one finish chunk, the choice's last, with no text.
        assert finish["finish_reason"] in ("stop", "length") and finish["text"] == ""
        assert all(c["finish_reason"] is None for c in texts)
        offsets: list[int] = []
        for choice in texts:
            assert isinstance(choice["token"], int)
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
            assert len(lp["top_logprobs"]) == len(lp["tokens"]) >= 1
            assert all(len(top) >= 1 for top in lp["top_logprobs"])
            offsets += lp["text_offset"]
        # text_offset goes on from the text already sent (the exact values: the parity test).
        assert offsets[0] == 0 and offsets == sorted(offsets)


CASES = {
    "greedy": {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0},
    "seeded, n and prompts": {
        "prompt": PROMPTS, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 11,
        "logprobs": 3,
    },
    "penalties, logit_bias": {
        "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.7, "seed": 3,
        "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"5": 20},
    },
    "echo with logprobs": {
        "prompt": [PROMPTS[0]], "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_and_not_give_the_same_text_usage_and_logprobs(
    service: Service, worker: Worker, key: str, case: str
) -> None:
    client = service.client(key)
    params = {"model": "demo", **CASES[case]}
    whole = client.completions.create(**params)
    chunks = list(
        client.completions.create(**params, stream=True, stream_options={"include_usage": True})
    )
    got = assemble([c.model_dump() for c in chunks if c.choices])
    assert sorted(got) == [c.index for c in whole.choices]
    for choice in whole.choices:
        streamed = got[choice.index]
        assert streamed.text == choice.text
        assert streamed.finish_reason == choice.finish_reason and streamed.finish_chunks == 1
        if choice.logprobs is None:
            assert not streamed.logprobs
            continue
        want = choice.logprobs.model_dump()
        assert streamed.logprobs["tokens"] == want["tokens"]
        assert streamed.logprobs["text_offset"] == want["text_offset"]
        assert streamed.logprobs["token_logprobs"] == pytest.approx(want["token_logprobs"])
        assert streamed.logprobs["top_logprobs"] == [
            None if t is None else pytest.approx(t) for t in want["top_logprobs"]
        ]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_a_stop_sequence_never_shows_in_a_chunk(service: Service, worker: Worker, key: str) -> None:
    client = service.client(key)
    params = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}
    free = client.completions.create(**params).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3
    cut = client.completions.create(**params, stop=[stop]).choices[0]
    chunks = list(client.completions.create(**params, stop=[stop], stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == cut.text == free[: free.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop" == cut.finish_reason
    assert all(stop not in t for t in texts)


def test_an_online_answer_is_the_batch_lines_answer(
    service: Service, worker: Worker, key: str
) -> None:
    """One code path: the same body online and as a batch line gives the same Completion
    (ids and timestamps aside)."""
    client = service.client(key)
    body = {"model": "demo", "prompt": PROMPTS, "n": 2, "max_tokens": 10, "temperature": 0.8,
            "seed": 5, "logprobs": 2, "stop": ["zz"]}  # fmt: skip
    online = client.completions.create(**body).model_dump()
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": body}
    upload = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.output_file_id is not None
    out = json.loads(client.files.content(batch.output_file_id).text)["response"]["body"]
    for field in ("id", "created"):
        online.pop(field), out.pop(field)
    assert (
        online["choices"] == out["choices"]
        and online["usage"]["total_tokens"] == out["usage"]["total_tokens"]
    )
