"""/v1/embeddings through the service with the official SDK: online and as a batch, float
and base64, and OpenAI's limits as 400s that name the input or the limit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer

from tests.conftest import Proc
from tests.embed.conftest import BATCH_INPUTS
from tests.embed.test_accuracy import TEXTS, close
from tests.shared.conftest import Service


@pytest.fixture(scope="module")
def st_models(embed_paths: dict[str, Path]) -> dict[str, Any]:
    return {name: SentenceTransformer(str(p), device="cpu") for name, p in embed_paths.items()}


@pytest.fixture(scope="module")
def client(service: Service, embed_worker: Proc) -> Any:
    return service.client(service.key("embed-team"))


@pytest.mark.parametrize("model", ["enc", "dec"])
def test_online_float_and_base64(client: Any, st_models: dict[str, Any], model: str) -> None:
    ref = st_models[model].encode(TEXTS)
    # The SDK asks for base64 when no format is given and decodes it itself.
    plain = client.embeddings.create(model=model, input=TEXTS)
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    for resp in (plain, floats):
        assert resp.object == "list" and resp.model == model
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        got = np.array([d.embedding for d in resp.data], dtype=np.float32)
        close(got, ref)
    assert np.array_equal(
        np.array([d.embedding for d in plain.data], dtype=np.float32),
        np.array([d.embedding for d in floats.data], dtype=np.float32),
    )
    ids = [st_models[model].tokenizer(t)["input_ids"] for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # One string, and token ids (one array, and several).
    one = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    close(np.array([one.data[0].embedding], dtype=np.float32), ref[:1])
    by_ids = client.embeddings.create(model=model, input=ids[1:3], encoding_format="float")
    close(np.array([d.embedding for d in by_ids.data], dtype=np.float32), ref[1:3])
    single = client.embeddings.create(model=model, input=ids[3])
    close(np.array([single.data[0].embedding], dtype=np.float32), ref[3:4])


def test_dimensions(client: Any, st_models: dict[str, Any]) -> None:
    resp = client.embeddings.create(model="enc", input=TEXTS, dimensions=16)
    ref = st_models["enc"].encode(TEXTS)[:, :16]
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    close(got, ref / np.linalg.norm(ref, axis=1, keepdims=True))
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="enc", input="hi", dimensions=20)
    assert "dimensions" in str(err.value) and "32" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="dec", input="hi", dimensions=16)
    assert "Matryoshka" in str(err.value)


def test_online_limits(client: Any) -> None:
    def refused(**kwargs: Any) -> str:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(**kwargs)
        assert err.value.status_code == 400
        return str(err.value)

    assert "2048" in refused(model="enc", input=["x"] * 2049)
    assert "input[3]" in refused(model="enc", input=["a", "b", "c", "", "e"])
    assert "empty" in refused(model="enc", input="")
    too_long = "word " * 600
    msg = refused(model="enc", input=["short", too_long])
    assert "input[1]" in msg and "512" in msg
    msg = refused(model="dec", input=[[1, 2], [5, 10**6]])
    assert "input[1]" in msg and "vocabulary" in msg
    msg = refused(model="demo", input="hello")
    assert "generation model" in msg
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="enc", prompt="hello")
    assert "embedding model" in str(err.value)


def _batch(service: Service, client: Any, lines: list[dict[str, Any]]) -> Any:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    upload = client.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )

    def ended() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    return service.wait(ended, what="batch end")


def test_batch_round_trip(service: Service, client: Any, st_models: dict[str, Any]) -> None:
    tok = st_models["dec"].tokenizer
    lines = [
        {"custom_id": "one", "body": {"model": "dec", "input": TEXTS[0]}},
        {"custom_id": "many", "body": {"model": "dec", "input": TEXTS}},
        {
            "custom_id": "b64",
            "body": {"model": "dec", "input": TEXTS[2:5], "encoding_format": "base64"},
        },
        {"custom_id": "ids", "body": {"model": "dec", "input": tok(TEXTS[5])["input_ids"]}},
        {"custom_id": "bad", "body": {"model": "dec", "input": ["ok", ""]}},
        {"custom_id": "dims", "body": {"model": "dec", "input": "x", "dimensions": 8}},
    ]
    for line in lines:
        line.update(method="POST", url="/v1/embeddings")
    batch = _batch(service, client, lines)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 4 and batch.request_counts.failed == 2
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["one", "many", "b64", "ids"]
    ref = st_models["dec"].encode(TEXTS)
    bodies = {o["custom_id"]: o["response"]["body"] for o in out}
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
    close(np.array([bodies["one"]["data"][0]["embedding"]], dtype=np.float32), ref[:1])
    close(np.array([d["embedding"] for d in bodies["many"]["data"]], dtype=np.float32), ref)
    b64 = [np.frombuffer(__import__("base64").b64decode(d["embedding"]), "<f4")
           for d in bodies["b64"]["data"]]  # fmt: skip
    close(np.stack(b64), ref[2:5])
    close(np.array([bodies["ids"]["data"][0]["embedding"]], dtype=np.float32), ref[5:6])
    # Batch usage: the sum of the lines' (embedding tokens count as input tokens).
    used = sum(b["usage"]["prompt_tokens"] for b in bodies.values())
    assert batch.usage.input_tokens == used and batch.usage.output_tokens == 0
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    by_id = {e["custom_id"]: e["response"] for e in errors}
    assert by_id["bad"]["status_code"] == 400
    assert "input[1]" in by_id["bad"]["body"]["error"]["message"]
    assert by_id["dims"]["body"]["error"]["param"] == "dimensions"


def test_batch_limits(service: Service, client: Any) -> None:
    """Inputs across the file (an array counts each element) and the model's task are the
    file's problems: validation fails and names them."""
    over = [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "enc", "input": ["a"] * 10},
        }
        for i in range(BATCH_INPUTS // 10 + 1)
    ]
    batch = _batch(service, client, over)
    assert batch.status == "failed"
    (err,) = batch.errors.data
    assert err.code == "too_many_tasks" and str(BATCH_INPUTS) in err.message
    assert err.line == len(over)
    wrong = [{**over[0], "body": {"model": "demo", "input": "hello"}}]
    batch = _batch(service, client, wrong)
    assert batch.status == "failed" and batch.errors.data[0].code == "invalid_model"
    assert "generation model" in batch.errors.data[0].message
    models = {m.id for m in client.models.list().data}
    assert {"enc", "dec", "demo"} <= models


def test_worker_serves_both_kinds_in_one_process(service: Service, client: Any) -> None:
    """An embedding model beside a generation model in one worker: each in its own loop."""
    (proc,) = service.workers(["--models", "demo,enc"])
    try:
        done = client.completions.create(model="demo", prompt="Once upon", max_tokens=4)
        assert done.usage.completion_tokens == 4
        emb = client.embeddings.create(model="enc", input=["a b c"] * 3)
        assert len(emb.data) == 3
    finally:
        proc.stop()
