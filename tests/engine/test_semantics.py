"""Request semantics: prompt formats, n/best_of, stop, EOS, limits, penalties, bias, seed."""

from __future__ import annotations

from typing import Any

EOS_BAN = {"0": -100}  # the demo tokenizer's <|endoftext|> is id 0


def _mean(lps: list[float]) -> float:
    return sum(lps) / len(lps)


def test_prompt_formats_and_choice_index(run: Any, direct: Any) -> None:
    a, b = "Hello world", "The sea"
    ids_a, ids_b = direct.ids(a), direct.ids(b)
    base = {"max_tokens": 5, "temperature": 0, "logit_bias": EOS_BAN}
    s = run.ok({**base, "prompt": a})
    texts = run.ok({**base, "prompt": [a, b], "n": 2})
    ids = run.ok({**base, "prompt": ids_a})
    many = run.ok({**base, "prompt": [ids_a, ids_b]})
    assert [c["index"] for c in texts["choices"]] == [0, 1, 2, 3]
    assert s["choices"][0]["text"] == ids["choices"][0]["text"] == texts["choices"][0]["text"]
    assert texts["choices"][0]["text"] == texts["choices"][1]["text"]  # greedy n=2
    assert [c["text"] for c in many["choices"]] == [
        texts["choices"][0]["text"],
        texts["choices"][2]["text"],
    ]
    assert texts["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b)
    assert texts["usage"]["completion_tokens"] == 4 * 5
    assert s["object"] == "text_completion" and s["id"].startswith("cmpl-")
    assert s["system_fingerprint"].startswith("fp_") and s["model"] == "test"


def test_best_of_returns_top_n_by_mean_logprob(run: Any) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 0,
        "logit_bias": EOS_BAN,
    }
    # Candidate j draws from seed (7, prompt, j) whatever best_of is: n=4 shows all of them.
    allc = run.ok({**body, "n": 4})
    best = run.ok({**body, "n": 2, "best_of": 4})
    ranked = sorted(allc["choices"], key=lambda c: -_mean(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    # Usage counts the candidates that were generated but not returned.
    assert best["usage"]["completion_tokens"] == 4 * 6


def test_stop_string_across_token_boundary(run: Any, engine: Any) -> None:
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": EOS_BAN,
        "logprobs": 0,
    }
    full = run.ok(body)["choices"][0]
    tokens = full["logprobs"]["tokens"]
    # A stop made of the end of token 2 and the start of token 3 spans a boundary.
    i = next(i for i in range(2, len(tokens) - 1) if tokens[i] and tokens[i + 1])
    stop = tokens[i][-1] + tokens[i + 1][0]
    cut = full["text"].find(stop)
    out = run.ok({**body, "stop": ["zzzz", stop]})["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full["text"][:cut]
    assert stop not in out["text"]
    assert "".join(out["logprobs"]["tokens"]).startswith(out["text"])


def test_eos_finishes_with_stop(run: Any) -> None:
    out = run.ok({"prompt": "Hi", "max_tokens": 5, "logit_bias": {"0": 100}})
    choice = out["choices"][0]
    assert choice == {"finish_reason": "stop", "index": 0, "logprobs": None, "text": ""}
    assert out["usage"]["completion_tokens"] == 1


def test_length_and_context_errors(run: Any, engine: Any) -> None:
    out = run.ok({"prompt": "Hi", "max_tokens": 3, "logit_bias": EOS_BAN})
    assert out["choices"][0]["finish_reason"] == "length"
    ctx = engine.lm.context_length
    res = run.one({"prompt": "Hello world", "max_tokens": ctx})
    assert res.status_code == 400
    assert res.error["code"] == "context_length_exceeded" and res.error["param"] == "max_tokens"
    assert str(ctx) in res.error["message"] and str(ctx + 6) in res.error["message"]
    bad = run.one({"prompt": [1, 2, 99999]})
    assert (
        bad.status_code == 400
        and bad.error["param"] == "prompt"
        and "99999" in bad.error["message"]
    )
    bad_bias = run.one({"prompt": "x", "logit_bias": {"99999": 1}})
    assert bad_bias.status_code == 400 and bad_bias.error["param"] == "logit_bias"
    invalid = run.one({"prompt": "x", "temperature": 5})
    assert invalid.status_code == 400 and invalid.error["param"] == "temperature"


def test_penalties_match_reference(run: Any, engine: Any, direct: Any) -> None:
    prompt = "Stop words, punctuation marks"
    ids = direct.ids(prompt)
    for pres, freq in [(1.5, 0.0), (0.0, 1.0), (0.7, 1.3), (-1.0, -0.5)]:
        out = run.ok(
            {
                "prompt": prompt,
                "max_tokens": 14,
                "temperature": 0,
                "presence_penalty": pres,
                "frequency_penalty": freq,
            }
        )
        want = direct.greedy(ids, 14, presence=pres, frequency=freq)
        if want[-1] in direct.eos:
            want = want[:-1]
        assert out["choices"][0]["text"] == engine.decode(want), (pres, freq)


def test_logit_bias_ban_and_force(run: Any, engine: Any, direct: Any) -> None:
    prompt = "Questions: What is"
    ids = direct.ids(prompt)
    first = direct.greedy(ids, 1)[0]
    banned = run.ok(
        {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logit_bias": {str(first): -100}}
    )
    want = direct.greedy(ids, 1, bias={first: -100})[0]
    assert want != first
    assert banned["choices"][0]["text"] == engine.decode([want])
    forced = run.ok(
        {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "logit_bias": {"42": 100}}
    )
    assert forced["choices"][0]["text"] == engine.decode([42] * 5)


def test_seed_reproducible_whatever_the_batch(run: Any, make_engine: Any) -> None:
    body = {
        "prompt": "The weather",
        "max_tokens": 10,
        "temperature": 1.2,
        "top_p": 0.9,
        "seed": 1234,
        "presence_penalty": 0.5,
        "logit_bias": EOS_BAN,
    }
    alone = run.ok(body)["choices"][0]["text"]
    others = [{"prompt": "x" * i, "max_tokens": 3 + i, "temperature": 0.7} for i in range(1, 6)]
    eng = make_engine(max_rows=4)
    mixed = run.many([*others[:3], body, *others[3:]], eng)
    assert mixed[3].completion["choices"][0]["text"] == alone
    other_seed = run.ok({**body, "seed": 4321})["choices"][0]["text"]
    assert other_seed != alone


def test_top_p_zero_is_greedy(run: Any) -> None:
    greedy = run.ok({"prompt": "Machine learning", "max_tokens": 8, "temperature": 0})
    nucleus = run.ok(
        {"prompt": "Machine learning", "max_tokens": 8, "temperature": 1.5, "top_p": 0.0}
    )
    assert greedy["choices"][0]["text"] == nucleus["choices"][0]["text"]


def test_usage_matches_tokenizer_counts(run: Any, direct: Any) -> None:
    prompts = ["a b c", "The quick brown fox jumps over the lazy dog."]
    out = run.ok(
        {
            "prompt": prompts,
            "max_tokens": 7,
            "n": 2,
            "best_of": 3,
            "logit_bias": EOS_BAN,
            "user": "someone",
        }
    )
    n_prompt = sum(len(direct.ids(p)) for p in prompts)
    assert out["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 2 * 3 * 7,
        "total_tokens": n_prompt + 42,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(out["choices"]) == 4


def test_max_tokens_zero_without_echo(run: Any) -> None:
    out = run.ok({"prompt": ["a", "b"], "max_tokens": 0, "n": 2})
    assert [c["text"] for c in out["choices"]] == ["", "", "", ""]
    assert out["usage"]["completion_tokens"] == 0


def test_tiny_temperatures_are_greedy(run: Any) -> None:
    # 1e-38 and 1e-45 are valid temperatures; dividing float32 logits by them overflows.
    # Below the documented epsilon (1e-5) a row is greedy.
    body = {"prompt": "The weather", "max_tokens": 12, "logprobs": 2, "logit_bias": EOS_BAN}
    greedy = run.ok({**body, "temperature": 0})["choices"][0]
    for t in (1e-45, 1e-38, 1e-30, 1e-6):
        tiny = run.ok({**body, "temperature": t, "seed": 5})["choices"][0]
        assert tiny["text"] == greedy["text"], t
        assert tiny["logprobs"]["token_logprobs"] == greedy["logprobs"]["token_logprobs"], t
