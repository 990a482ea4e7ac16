"""Greedy decoding and logprobs against full forward passes of the same model."""

from __future__ import annotations

import math
from typing import Any

import pytest

from batchwright.engine.requests.types import GenRequest
from batchwright.serving.lines import serve

PROMPTS = [
    "The quick brown fox",
    "A",
    "Once upon a time there was a little model that learned to write stories about the sea",
    "Numbers like 0 1 2 3",
    "Why is the sky blue? Because",
]


def _text(direct: Any, engine: Any, ids: list[int]) -> str:
    if ids and ids[-1] in direct.eos:
        ids = ids[:-1]
    return str(engine.decode(ids))


def test_greedy_batch_equals_direct_argmax(run: Any, engine: Any, direct: Any) -> None:
    # Different prompt lengths share one left-padded prefill and one decode batch.
    results = run.many(
        [{"prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 3} for p in PROMPTS]
    )
    for prompt, res in zip(PROMPTS, results, strict=True):
        ids = direct.ids(prompt)
        want = direct.greedy(ids, 12)
        choice = res.completion["choices"][0]
        assert choice["text"] == _text(direct, engine, want)
        # logprobs are the raw model's log-softmax at each generated position.
        lp = choice["logprobs"]
        full = direct.logprobs(ids + want)
        for i, tok in enumerate(want[: len(lp["token_logprobs"])]):
            row = full[len(ids) - 1 + i]
            assert lp["token_logprobs"][i] == pytest.approx(float(row[tok]), abs=1e-4)
            top = row.topk(3)
            want_top: dict[str, float] = {}
            for t, v in zip(top.indices, top.values, strict=True):
                want_top.setdefault(engine.token_text(int(t)), float(v))
            got = lp["top_logprobs"][i]
            for key, val in want_top.items():
                assert got[key] == pytest.approx(val, abs=1e-4)
            assert len(got) <= 4
            assert engine.token_text(tok) in got


def test_continuous_batching_matches_one_at_a_time(run: Any, make_engine: Any) -> None:
    small = make_engine(max_rows=3, max_batch_tokens=64)
    bodies = [
        {"prompt": p * (1 + i % 2), "max_tokens": 3 + 4 * (i % 3), "temperature": 0}
        for i, p in enumerate(PROMPTS * 2)
    ]
    together = run.many(bodies, small)
    for body, res in zip(bodies, together, strict=True):
        alone = run.ok(body, small)
        assert res.completion["choices"][0]["text"] == alone["choices"][0]["text"]


def test_run_reads_a_bounded_window_and_yields_early(make_engine: Any) -> None:
    eng = make_engine(max_rows=2)
    pulled = 0

    def source() -> Any:
        nonlocal pulled
        for i in range(6):
            pulled += 1
            yield GenRequest(
                i, {"model": "t", "prompt": "Hello", "max_tokens": 4 + i, "temperature": 0}
            )

    seen = []
    for res in serve(eng, source()):
        seen.append((res.key, pulled))
    # A window of 2 x max_rows requests is read ahead, and the longest generations in it
    # (3 and 2) are admitted first: 2 finishes first, before the rest is read.
    assert seen[0] == (2, 4)
    assert sorted(k for k, _ in seen) == list(range(6))


def test_echo_logprobs_first_is_null(run: Any, engine: Any, direct: Any) -> None:
    prompt = "The weather today is sunny"
    out = run.ok({"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2})
    choice = out["choices"][0]
    ids = direct.ids(prompt)
    gen = direct.greedy(ids, 4)
    assert choice["text"] == prompt + _text(direct, engine, gen)
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    full = direct.logprobs(ids + gen)
    for i in range(1, len(ids) + len(gen)):
        tok = (ids + gen)[i]
        assert lp["token_logprobs"][i] == pytest.approx(float(full[i - 1, tok]), abs=1e-4)
    assert lp["tokens"][: len(ids)] == [engine.token_text(t) for t in ids]
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][len(ids)] == len(prompt)


def test_max_tokens_zero_echo_scores_prompt(run: Any, direct: Any) -> None:
    prompt = "She said hello, he said goodbye"
    out = run.ok({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    ids = direct.ids(prompt)
    choice = out["choices"][0]
    assert choice["text"] == prompt
    assert choice["finish_reason"] == "length"
    lps = choice["logprobs"]["token_logprobs"]
    full = direct.logprobs(ids)
    assert lps[0] is None
    assert len(lps) == len(ids)
    total = sum(float(full[i - 1, ids[i]]) for i in range(1, len(ids)))
    assert math.isclose(sum(lps[1:]), total, abs_tol=1e-3)
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
