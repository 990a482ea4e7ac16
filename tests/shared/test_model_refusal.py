"""A worker whose model the engine refuses: one log line, the model not advertised, the
reason on /v1/models, and a batch for it failed at validation with that reason (it would
otherwise wait for a worker that never takes it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers as tr

from tests.engine.model_zoo import _TOKENIZER, EOS, VOCAB
from tests.helpers import jsonl, line, submit, wait_batch
from tests.shared.conftest import Service, run_service


@pytest.fixture(scope="module")
def refusing(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = tmp_path_factory.mktemp("bert")
    config = tr.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        pad_token_id=EOS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tr.BertForMaskedLM(config).save_pretrained(path)
    _TOKENIZER.save_pretrained(path)
    models = {"models": {"bert": {"path": str(path)}}}
    yield from run_service(bw_home, tmp_path_factory, BATCHWRIGHT_MODELS=json.dumps(models))


def test_a_refused_model_is_not_advertised_and_its_batch_fails_with_why(
    refusing: Service,
) -> None:
    svc = refusing
    (worker,) = svc.workers(["--models", "bert"])
    key = svc.key("p")

    def listed() -> dict[str, object]:
        r = httpx.get(
            svc.api_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
        )
        (model,) = [m for m in r.json()["data"] if m["id"] == "bert"]
        return dict(model)

    model = svc.wait(lambda: (m := listed()).get("unavailable") and m, what="the refusal")
    assert "not a causal decoder" in str(model["unavailable"])
    assert not model["live_workers"]
    logged = [ln for ln in worker.output().splitlines() if "refused at load" in ln]
    assert len(logged) == 1 and "not a causal decoder" in logged[0]
    assert "Traceback" not in worker.output()
    beats = svc.sql("SELECT models FROM worker_heartbeats WHERE models <> ''")
    assert all("bert" not in m for (m,) in beats)

    client = svc.client(key)
    batch = submit(client, jsonl([line("a", {"model": "bert", "prompt": "hi", "max_tokens": 2})]))
    done = wait_batch(client, batch.id, timeout=120)
    assert done.status == "failed"
    (error,) = done.errors.data
    assert error.code == "model_unavailable" and "not a causal decoder" in error.message
