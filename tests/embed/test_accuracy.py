"""Embeddings equal sentence-transformers' `encode` of the same model, in fp32: a tiny random
BERT-style encoder and a tiny random Qwen3-style decoder built here in sentence-transformers'
layout, inputs as text and as token ids, packed with inputs of other lengths, through the
worker's embedding runner (the path batch lines and online requests take)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from batchwright.engine.embed.engine import EmbedEngine
from batchwright.engine.embed.tiny import build_decoder, build_encoder
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.worker.generation.embedding import EmbeddingRunner

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Once upon a time there was a little model that learned to write stories about the "
    "sea, the mountains, the rivers and the people who lived in the small towns along "
    "the coast. " * 3,
    "Paris is the capital of France.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in many documents.",
    "hello world",
    "Why is the sky blue? Because sunlight is scattered by the air.",
    "Paris is the capital of Peru.",  # the same length as another: one attention call
]


def close(got: np.ndarray, ref: np.ndarray) -> None:
    """The issue's bar: cosine >= 0.99999 and max abs difference <= 1e-5, every vector."""
    assert got.shape == ref.shape
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-5, np.abs(got - ref).max()


Build = Callable[..., Path]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Any, EmbeddingRunner]]:
    made: dict[tuple[str, str], tuple[Any, EmbeddingRunner]] = {}
    logging.getLogger("transformers").setLevel(logging.ERROR)

    def make(build: Build, **options: Any) -> tuple[Any, EmbeddingRunner]:
        key = (build.__name__, repr(sorted(options.items())))
        if key not in made:
            path = build(tmp_path_factory.mktemp("embed") / "m", **options)
            st = SentenceTransformer(str(path), device="cpu")
            # A small token budget: the inputs go through several forwards, each packing
            # inputs of different lengths together.
            spec = ModelSpec(name="m", path=path, device="cpu", max_batch_tokens=96)
            made[key] = st, EmbeddingRunner(EmbedEngine.load(spec))
        return made[key]

    return make


def embed(runner: EmbeddingRunner, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    requests = [GenRequest(key=i, body={"model": "m", **b}) for i, b in enumerate(bodies)]
    results = {r.key: r for r in runner.run(requests)}
    out = []
    for i in range(len(bodies)):
        r = results[i]
        assert r.status_code == 200, r.error
        assert r.completion is not None
        out.append(r.completion)
    return out


def vectors(body: dict[str, Any]) -> np.ndarray:
    rows = []
    for item in body["data"]:
        e = item["embedding"]
        rows.append(np.frombuffer(base64.b64decode(e), "<f4") if isinstance(e, str) else e)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("build", [build_encoder, build_decoder], ids=["encoder", "decoder"])
def test_text_and_token_ids_match_sentence_transformers(
    models: Callable[..., tuple[Any, EmbeddingRunner]], build: Build
) -> None:
    st, runner = models(build)
    ref = st.encode(TEXTS, batch_size=3, convert_to_numpy=True)
    # One request per text, and one request holding them all: both packed with others.
    single = embed(runner, [{"input": t} for t in TEXTS])
    close(np.concatenate([vectors(b) for b in single]), ref)
    together = embed(runner, [{"input": TEXTS}])[0]
    assert [d["index"] for d in together["data"]] == list(range(len(TEXTS)))
    close(vectors(together), ref)
    # The same tokens as ids: embedded exactly as given (nothing added).
    ids = [runner.lm.tokenizer(t)["input_ids"] for t in TEXTS]
    by_ids = embed(runner, [{"input": ids}, {"input": ids[2]}])
    close(vectors(by_ids[0]), ref)
    close(vectors(by_ids[1]), ref[2:3])
    # Usage counts what the model read, special tokens included.
    assert together["usage"] == {
        "prompt_tokens": sum(len(x) for x in ids),
        "total_tokens": sum(len(x) for x in ids),
    }
    # base64 is the same float32 vectors, little-endian.
    b64 = embed(runner, [{"input": TEXTS, "encoding_format": "base64"}])[0]
    assert all(isinstance(d["embedding"], str) for d in b64["data"])
    np.testing.assert_array_equal(vectors(b64), vectors(together))


@pytest.mark.parametrize(
    "pooling", ["cls", "max", "weightedmean", "mean_sqrt_len_tokens", "lasttoken"]
)
def test_encoder_pooling_modes(
    models: Callable[..., tuple[Any, EmbeddingRunner]], pooling: str
) -> None:
    st, runner = models(build_encoder, pooling=pooling, normalize=pooling != "max")
    close(vectors(embed(runner, [{"input": TEXTS}])[0]), st.encode(TEXTS, batch_size=3))


@pytest.mark.parametrize("build", [build_encoder, build_decoder], ids=["encoder", "decoder"])
def test_default_prompt_left_out_of_pooling(
    models: Callable[..., tuple[Any, EmbeddingRunner]], build: Build
) -> None:
    st, runner = models(
        build,
        pooling="mean",
        prompts={"query": "Represent this sentence for searching: "},
        default_prompt="query",
        include_prompt=False,
    )
    body = embed(runner, [{"input": TEXTS}])[0]
    close(vectors(body), st.encode(TEXTS, batch_size=3))
    ids = [runner.lm.tokenizer("Represent this sentence for searching: " + t) for t in TEXTS]
    assert body["usage"]["prompt_tokens"] == sum(len(x["input_ids"]) for x in ids)


def test_matryoshka_dimensions_truncate_and_renormalise(
    models: Callable[..., tuple[Any, EmbeddingRunner]],
) -> None:
    st, runner = models(build_encoder, matryoshka=[32, 16])
    body = embed(runner, [{"input": TEXTS, "dimensions": 16}])[0]
    ref = st.encode(TEXTS, batch_size=3)[:, :16]
    close(vectors(body), ref / np.linalg.norm(ref, axis=1, keepdims=True))


def test_padded_path_matches_too(models: Callable[..., tuple[Any, EmbeddingRunner]]) -> None:
    """Models the packed attention cannot run go through padded batches: same vectors."""
    st, runner = models(build_decoder, seed=1)
    runner.lm.packed = False
    try:
        close(vectors(embed(runner, [{"input": TEXTS}])[0]), st.encode(TEXTS, batch_size=3))
    finally:
        runner.lm.packed = True


def test_cancels_and_online_requests_through_the_run_contract(
    models: Callable[..., tuple[Any, EmbeddingRunner]],
) -> None:
    """The engine host's contract: a cancelled key gets no result; an online request (the
    relay's feed) is started, and answered ahead of the batch lines waiting with it."""
    st, runner = models(build_encoder)
    lines = [GenRequest(key=("line", i), body={"model": "m", "input": TEXTS}) for i in range(6)]
    asked: list[int] = []

    def cancelled() -> set[Any]:
        # Asked once a forward: at the second, line 0 was read (the first forward was the
        # online request's alone) and waits.
        asked.append(1)
        return {("line", 0)} if len(asked) == 2 else set()

    class Feed:
        def __init__(self) -> None:
            self.sent = False
            self.begun: list[tuple[Any, int]] = []

        def take(self) -> list[GenRequest]:
            if self.sent:
                return []
            self.sent = True
            return [GenRequest(key="online", body={"model": "m", "input": TEXTS[:2]})]

        def started(self, key: Any, tokens: int) -> None:
            self.begun.append((key, tokens))

        def rows(self, online: int) -> None:
            pass

    feed = Feed()
    results = list(runner.run(lines, cancelled, feed))  # type: ignore[arg-type]
    keys = [r.key for r in results]
    assert keys[0] == "online"
    assert ("line", 0) not in keys and len(keys) == 6
    close(vectors(results[0].completion), st.encode(TEXTS[:2]))  # type: ignore[arg-type]
    ids = runner.lm.tokenizer(TEXTS[:2])["input_ids"]
    assert feed.begun == [("online", sum(map(len, ids)))]
