"""Chat lines and structured outputs in the engine (engine/chat.py, engine/grammar.py).

A chat line is a completion of the prompt its template renders: same rows, same tokens.
A line with a response_format gets only tokens its grammar allows; every line that ends
with "stop" parses and validates against its schema.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import jsonschema
import pytest

from batchwright.engine.engine import Engine
from batchwright.engine.loading.demo import TEMPLATE_FILE, ensure_demo_model
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.serving.lines import serve
from tests.engine.conftest import Runner

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "color", "tags", "home"],
}


def _schema_format(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def _chat(**over: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **over}


def test_chat_line_is_its_rendered_prompt(run: Runner, engine: Engine) -> None:
    rendered = "system: You answer in one line.\nuser: What is the capital of France?\nassistant:"
    chat, completion = run.many([_chat(), {"prompt": rendered, "max_tokens": 8, "temperature": 0}])
    assert chat.status_code == 200, chat.error
    body = chat.completion
    assert body is not None and completion.completion is not None
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["system_fingerprint"] == engine.system_fingerprint
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    # Same rows, same tokens: the chat answer is the completion of the rendered prompt.
    assert choice["message"]["content"] == completion.completion["choices"][0]["text"]
    assert choice["finish_reason"] == completion.completion["choices"][0]["finish_reason"]
    same = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [body["usage"][k] for k in same] == [completion.completion["usage"][k] for k in same]
    assert body["usage"]["prompt_tokens"] == len(engine._tok(rendered).input_ids)


def test_chat_and_completion_lines_share_rows(run: Runner) -> None:
    # Seeded sampled lines of both kinds in one run give what each gives alone.
    bodies = [
        _chat(temperature=0.9, seed=11, n=2, max_tokens=6),
        {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.9, "seed": 5},
        _chat(messages=[{"role": "developer", "content": "Be brief."}, MESSAGES[1]], seed=2),
    ]
    together = run.many(bodies)
    alone = [run.one(b) for b in bodies]
    assert [r.completion["choices"] for r in together] == [  # type: ignore[index]
        r.completion["choices"]
        for r in alone  # type: ignore[index]
    ]


def test_chat_logprobs_shape(run: Runner) -> None:
    chat, completion = run.many(
        [
            _chat(logprobs=True, top_logprobs=20, max_tokens=4),
            {"prompt": "Hello", "max_tokens": 4, "logprobs": 5, "temperature": 0},
        ]
    )
    content = chat.completion["choices"][0]["logprobs"]["content"]  # type: ignore[index]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 20
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]
        assert isinstance(entry["bytes"], list) and entry["bytes"]
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
    # A completion row sharing the step still gets its own k.
    tops = completion.completion["choices"][0]["logprobs"]["top_logprobs"]  # type: ignore[index]
    assert all(len(t) in (5, 6) for t in tops)
    none = run.one(_chat(logprobs=True, max_tokens=2))
    assert none.completion["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []  # type: ignore[index]


def test_chat_parameter_errors_name_the_parameter(run: Runner) -> None:
    cases = {
        "tools": _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        "tool_choice": _chat(tool_choice="auto"),
        "functions": _chat(functions=[]),
        "audio": _chat(audio={"voice": "x"}),
        "modalities": _chat(modalities=["text", "audio"]),
        "messages[1].content[0].type": _chat(
            messages=[
                MESSAGES[0],
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            ]
        ),
        "top_logprobs": _chat(logprobs=True, top_logprobs=21),
        "max_tokens": _chat(max_tokens=10_000),
    }
    results = run.many(cases.values())
    for param, result in zip(cases, results, strict=True):
        assert result.status_code == 400, param
        assert result.error is not None and result.error["param"] == param, result.error
        assert param.split("[")[0] in result.error["message"]
    unsupported = [r.error for r in results[:5]]
    assert all(e is not None and "not supported" in e["message"] for e in unsupported)


def test_metadata_and_store_are_accepted(run: Runner) -> None:
    result = run.one(_chat(metadata={"team": "a"}, store=True, user="u1", max_tokens=2))
    assert result.status_code == 200, result.error


def test_model_without_a_template_says_so(tmp_path: Path, demo_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(demo_path, bare)
    (bare / TEMPLATE_FILE).unlink()
    from batchwright.registry import ModelSpec

    engine = Engine.load(ModelSpec(name="bare", path=bare, max_rows=4))
    (result,) = list(serve(engine, [GenRequest(0, {"model": "bare", **_chat()})]))
    assert result.status_code == 400
    assert result.error is not None and result.error["param"] == "model"
    assert "no chat template" in result.error["message"]
    # A registry entry may name a template file instead.
    (bare / "my.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    named = Engine.load(ModelSpec(name="bare", path=bare, max_rows=4, chat_template="my.jinja"))
    (ok,) = list(serve(named, [GenRequest(0, {"model": "bare", **_chat()})]))
    assert ok.status_code == 200, ok.error
    assert ok.prompt_tokens == len(named._tok("".join(m["content"] for m in MESSAGES)).input_ids)


def test_cached_demo_model_gets_its_template(tmp_path: Path, demo_path: Path) -> None:
    # A demo model built before chat lines existed (no template) is given one in place.
    old = tmp_path / "demo"
    shutil.copytree(demo_path, old)
    (old / TEMPLATE_FILE).unlink()
    ensure_demo_model(old)
    assert (old / TEMPLATE_FILE).read_text() == (demo_path / TEMPLATE_FILE).read_text()


def _valid(text: str, schema: dict[str, Any]) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


def test_json_schema_lines_validate(run: Runner, engine: Engine) -> None:
    fmt = _schema_format(PERSON)
    bodies = [
        _chat(response_format=fmt, max_tokens=120, temperature=t, seed=i)
        for i, t in enumerate([0.0, 0.7, 1.0, 1.3] * 3)
    ]
    bodies.append(_chat(response_format=fmt, max_tokens=5))  # too short to finish
    bodies.append({"prompt": "JSON:", "max_tokens": 120, "response_format": fmt, "seed": 3})
    before = engine.grammars.compiled
    results = run.many(bodies)
    stops = 0
    for result in results[:-2] + results[-1:]:
        choice = result.completion["choices"][0]  # type: ignore[index]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] == "stop":
            stops += 1
            assert _valid(text, PERSON)
    assert stops >= len(bodies) // 2  # the demo model finishes most within 120 tokens
    short = results[-2].completion["choices"][0]  # type: ignore[index]
    assert short["finish_reason"] == "length"
    assert short["message"]["content"].startswith('{"')  # the text as generated: cut short
    with pytest.raises(ValueError):
        json.loads(short["message"]["content"])
    assert results[-2].completion_tokens == 5  # type: ignore[union-attr]
    # One schema, one compile, however many lines (and kinds of line) use it.
    assert engine.grammars.compiled - before <= 1


def test_json_object_and_strict_false(run: Runner) -> None:
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    results = run.many(
        [
            _chat(response_format={"type": "json_object"}, max_tokens=80, seed=1),
            _chat(response_format=_schema_format(loose, strict=False), max_tokens=80, seed=2),
            _chat(response_format={"type": "text"}, max_tokens=4),
        ]
    )
    for result, schema in zip(results[:2], [{"type": "object"}, loose], strict=True):
        choice = result.completion["choices"][0]  # type: ignore[index]
        if choice["finish_reason"] == "stop":
            assert _valid(choice["message"]["content"], schema)
        else:
            assert choice["message"]["content"].startswith("{")
    assert results[2].status_code == 200


def test_schema_the_library_rejects(run: Runner) -> None:
    bad = _schema_format({"type": "string", "pattern": "(?<=a)b"})  # look-behind
    rejected, fine = run.many([_chat(response_format=bad), _chat(max_tokens=3)])
    assert rejected.status_code == 400
    assert rejected.error is not None and rejected.error["param"] == "response_format"
    assert "cannot be enforced" in rejected.error["message"]
    assert fine.status_code == 200
    invalid = run.one(_chat(response_format=_schema_format({"type": "nope"})))
    assert invalid.status_code == 400
    assert invalid.error is not None and invalid.error["param"] == "response_format"


def test_a_line_waiting_for_its_grammar_holds_no_other(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_rows=4)
    engine.grammars.time_limit = 0  # the gate holds the compile as long as the test needs
    gate = threading.Event()
    compile_ = engine.grammars._compile

    def slow(fmt: Any) -> Any:
        assert gate.wait(120), "the test never opened the gate"
        return compile_(fmt)

    engine.grammars._compile = slow  # type: ignore[method-assign]
    feed: Queue[GenRequest | None] = Queue()

    def requests() -> Iterator[GenRequest]:
        while (item := feed.get()) is not None:
            yield item

    results: Queue[GenResult] = Queue()
    fmt = _schema_format(PERSON)
    feed.put(GenRequest("json", {"model": "t", **_chat(response_format=fmt, max_tokens=40)}))
    for i in range(6):
        feed.put(GenRequest(i, {"model": "t", **_chat(max_tokens=6, seed=i, temperature=1.0)}))
    feed.put(None)
    runner = threading.Thread(target=lambda: [results.put(r) for r in serve(engine, requests())])
    runner.start()
    # Every plain line finishes while the constrained one still waits for its grammar.
    plain = {results.get(timeout=120).key for _ in range(6)}
    assert plain == set(range(6))
    gate.set()
    last = results.get(timeout=120)
    runner.join(timeout=120)
    assert last.key == "json" and last.status_code == 200, last.error


def test_online_chat_with_a_schema(run: Runner, engine: Engine) -> None:
    # An online request (the engine's online lane) waits for its grammar, then follows it;
    # one whose schema fails is answered with a 400; a streamed one gets deltas.
    from tests.engine.test_lane import Feed

    fmt = _schema_format(PERSON)
    bad = _schema_format({"type": "string", "pattern": "(?<=a)b"})
    feed = Feed(
        {
            1: [
                GenRequest("ok", {"model": "t", **_chat(response_format=fmt, max_tokens=120)}),
                GenRequest("bad", {"model": "t", **_chat(response_format=bad)}),
                GenRequest(
                    "streamed",
                    {"model": "t", **_chat(response_format=fmt, max_tokens=120, seed=4)},
                    stream=True,
                ),
            ]
        }
    )
    batch = [GenRequest(i, {"model": "t", **_chat(max_tokens=30, seed=i)}) for i in range(4)]
    results = {r.key: r for r in serve(engine, batch, online=feed)}
    assert results["bad"].status_code == 400
    assert results["bad"].error is not None and results["bad"].error["param"] == "response_format"
    for key in ("ok", "streamed"):
        choice = results[key].completion["choices"][0]  # type: ignore[index]
        if choice["finish_reason"] == "stop":
            assert _valid(choice["message"]["content"], PERSON)
    streamed = "".join(d["text"] for _, deltas in feed.deltas["streamed"] for d in deltas)
    assert streamed == results["streamed"].completion["choices"][0]["message"]["content"]  # type: ignore[index]
    assert all(results[i].status_code == 200 for i in range(4))


def test_a_shared_system_prompt_is_prefilled_once(run: Runner) -> None:
    # The template renders the system message first: chat lines that share it share a
    # token prefix, and the prefix cache serves it (usage says so in cached_tokens).
    system = {"role": "system", "content": "The quick brown fox jumps over the lazy dog. " * 12}
    bodies = [
        _chat(messages=[system, {"role": "user", "content": f"Question {i}?"}], max_tokens=3)
        for i in range(12)
    ]
    results = run.many(bodies)
    cached = [r.completion["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]  # type: ignore[index]
    assert max(cached) >= 64, cached  # at least one full KV block of the system prompt
