"""Chat batch files in OpenAI's documented shape, through the official SDK."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tests.helpers import jsonl, read_jsonl, wait_batch

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
RECIPE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["title", "servings", "steps"],
    "additionalProperties": False,
}


def chat_line(custom_id: str, **body: Any) -> dict[str, Any]:
    # As OpenAI's Batch API guide writes a chat line.
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": "demo",
            "messages": [SYSTEM, {"role": "user", "content": f"Hello world {custom_id}"}],
            "max_tokens": 10,
            **body,
        },
    }


def submit_chat(client: Any, lines: list[dict[str, Any]]) -> Any:
    f = client.files.create(file=("chat.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")


def test_chat_batch_file_runs_unchanged(client: Any) -> None:
    lines = [chat_line(f"request-{i}", temperature=0.5, seed=i) for i in range(6)]
    lines.append(
        chat_line("lp", logprobs=True, top_logprobs=2, max_tokens=None, max_completion_tokens=3)
    )
    lines.append(chat_line("meta", metadata={"k": "v"}, store=True, n=2))
    batch = submit_chat(client, lines)
    assert batch.endpoint == CHAT
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == len(lines) and done.error_file_id is None
    out = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    usage = 0
    for o in out:
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["system_fingerprint"]
        for choice in body["choices"]:
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
            assert choice["finish_reason"] in ("stop", "length")
        usage += body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert len(out[-1]["response"]["body"]["choices"]) == 2
    content = out[-2]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] for c in content)
    assert done.usage.total_tokens == usage


def test_chat_line_errors_name_the_parameter(client: Any) -> None:
    image = [{"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}}]
    lines = [
        chat_line("ok"),
        chat_line("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat_line("image", messages=[SYSTEM, {"role": "user", "content": image}]),
        chat_line("modalities", modalities=["audio"]),
        chat_line(
            "bad-schema",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
            },
        ),
    ]
    done = wait_batch(client, submit_chat(client, lines).id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 1 and done.request_counts.failed == 4
    errors = {e["custom_id"]: e["response"] for e in read_jsonl(client, done.error_file_id)}
    params = {cid: r["body"]["error"]["param"] for cid, r in errors.items()}
    assert params == {
        "tools": "tools",
        "image": "messages[1].content[0].type",
        "modalities": "modalities",
        "bad-schema": "response_format",
    }
    assert all(r["status_code"] == 400 for r in errors.values())


def test_a_completion_line_in_a_chat_batch(client: Any) -> None:
    completion = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": "hi"},
    }
    done = wait_batch(client, submit_chat(client, [chat_line("a"), completion]).id)
    assert done.status == "failed"
    assert [(e.code, e.line) for e in done.errors.data] == [("url_mismatch", 2)]


def test_json_schema_dataset_job(client: Any) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True},
    }
    lines = [
        chat_line(f"row-{i}", response_format=fmt, max_tokens=150, temperature=0.8, seed=i)
        for i in range(12)
    ]
    done = wait_batch(client, submit_chat(client, lines).id)
    assert done.status == "completed", done
    stops = 0
    for o in read_jsonl(client, done.output_file_id):
        choice = o["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            stops += 1
            jsonschema.validate(json.loads(choice["message"]["content"]), RECIPE)
    assert stops > 0
