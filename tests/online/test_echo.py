"""Echo through the online endpoint: the prompt as the first chunk of each choice, and
scoring as lm-evaluation-harness's `local-completions` asks for it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.online.e2e import Worker, events, parse, sse, start_worker
from tests.shared.conftest import Service

PROMPTS = ["Once upon a time", "The quick brown fox"]


@pytest.fixture(scope="module")
def worker(service: Service) -> Iterator[Worker]:
    got = start_worker(service, "demo")
    yield got
    got.proc.stop()


@pytest.fixture(scope="module")
def key(service: Service) -> str:
    return service.key("team-echo")


def test_the_echo_is_the_first_chunk_of_each_choice(
    service: Service, worker: Worker, key: str
) -> None:
    body = {
        "model": "demo", "prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0.9,
        "seed": 3, "logprobs": 1, "echo": True, "stream": True,
    }  # fmt: skip
    with sse(service, key, body) as response:
        assert response.status_code == 200
        chunks = parse(events(response))
    firsts: dict[int, dict[str, object]] = {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == [0, 1, 2, 3]
    for index, first in firsts.items():
        # The prompt alone, no generated token with it; prompt logprobs, the first null.
        assert first["text"] == PROMPTS[index // 2] and first["token"] is None
        logprobs = first["logprobs"]
        assert isinstance(logprobs, dict) and logprobs["token_logprobs"][0] is None
        assert logprobs["text_offset"][0] == 0


def test_echo_scoring_as_lm_evaluation_harness_asks(
    service: Service, worker: Worker, key: str
) -> None:
    """local-completions scores a continuation: echo, logprobs, no new tokens, often token
    ids for several requests at once."""
    client = service.client(key)
    tokenized = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = tokenized.choices[0]
    assert choice.text == PROMPTS[1]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert tokenized.usage is not None and tokenized.usage.completion_tokens == 0
    assert tokenized.usage.prompt_tokens == len(lp.tokens)
    # The same prompt as token ids, twice in one request (a harness's batch of requests).
    ids = [_token_ids(service, PROMPTS[1])] * 2
    scored = client.completions.create(
        model="demo", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0, seed=1234
    )
    assert [c.index for c in scored.choices] == [0, 1]
    for c in scored.choices:
        assert c.logprobs is not None
        assert c.logprobs.token_logprobs == pytest.approx(lp.token_logprobs)
    # Streamed, the echo is the first chunk and the scores come with it.
    chunks = list(
        client.completions.create(
            model="demo", prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1, stream=True
        )
    )
    assert [c.choices[0].text for c in chunks] == [PROMPTS[1], ""]
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.token_logprobs == pytest.approx(lp.token_logprobs)
    assert chunks[-1].choices[0].finish_reason == "length"


def _token_ids(service: Service, prompt: str) -> list[int]:
    """The prompt's token ids, as the model's tokenizer gives them (what a harness sends)."""
    from transformers import AutoTokenizer

    path = json.loads(service.env["BATCHWRIGHT_MODELS"])["models"]["demo"]["path"]
    return [int(t) for t in AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]]
