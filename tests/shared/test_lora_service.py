"""LoRA adapters through the service and the official SDK: added with the CLI while a worker
of the base runs (no restart), listed with their parent, batches of two adapters and the
base sharing the worker's steps, online requests (plain and streamed), all equal to PEFT
for the same base and adapter; malformed adapters refused in one line; a removed adapter
refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lora_models import PeftOracle, build_adapter
from tests.shared.conftest import METRICS, Service

PROMPTS = ["Once upon a time", "The quick brown fox", "Questions: What is", "Numbers like 0 1"]
TOKENS = 8


@pytest.fixture(scope="module")
def lora_dirs(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = bw_home / "models" / "demo"
    root = tmp_path_factory.mktemp("lora")
    return {
        "sql-a": build_adapter(
            base, root / "a", r=8, targets=["q_proj", "v_proj"], alpha=16, seed=11
        ),
        "sql-b": build_adapter(
            base,
            root / "b",
            r=16,
            targets=["gate_proj", "up_proj", "down_proj", "o_proj"],
            alpha=16,
            seed=12,
        ),
        "too-wide": build_adapter(base, root / "w", r=32, targets=["q_proj"], alpha=8, seed=13),
    }


def _greedy(oracle: PeftOracle, tok: Any, eos: set[int], name: str | None, prompt: str) -> str:
    ids = list(tok(prompt).input_ids)
    return str(tok.decode(oracle.greedy(ids, TOKENS, name, eos)))


def _batch(client: Any, model: str) -> Any:
    lines = [
        {
            "custom_id": f"{model}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": p, "max_tokens": TOKENS, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS * 2)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )


def test_adapters_through_the_sdk_equal_peft(
    svc: Service, bw_home: Path, lora_dirs: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    base = bw_home / "models" / "demo"
    (worker,) = svc.workers(["--models", "demo"])
    # Added while the worker runs: it picks them up without a restart.
    for name in ("sql-a", "sql-b"):
        out = svc.cli("adapters", "add", name, "--base", "demo", "--path", str(lora_dirs[name]))
        assert out.returncode == 0, out.stderr
    # Malformed: refused at once, in one line that says why.
    wide = svc.cli(
        "adapters", "add", "wide", "--base", "demo", "--path", str(lora_dirs["too-wide"])
    )
    assert wide.returncode == 2
    assert wide.stderr.strip().count("\n") == 0
    assert "rank 32 is above the base's max_lora_rank 16" in wide.stderr
    nobase = svc.cli("adapters", "add", "x", "--base", "nope", "--path", str(lora_dirs["sql-a"]))
    assert nobase.returncode == 2 and "base 'nope' is not a model" in nobase.stderr
    listed = svc.cli("adapters", "list")
    assert "sql-a" in listed.stdout and "sql-b" in listed.stdout

    client = svc.client(svc.key("lora-team"))
    models = {m.id: m for m in client.models.list()}
    assert models["sql-a"].model_extra["parent"] == "demo"
    assert models["demo"].model_extra.get("parent") is None

    # Two adapters and the base: three batches whose lines share the worker's steps.
    batches = [_batch(client, m) for m in ("sql-a", "sql-b", "demo")]
    # An online request of an adapter beside them, and a streamed one.
    online = client.completions.create(
        model="sql-a", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="sql-b", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0, stream=True
        )
        if c.choices
    )
    done = []
    for b in batches:
        done.append(
            svc.wait(
                lambda b=b: (x := client.batches.retrieve(b.id)).status == "completed" and x,
                what=f"batch {b.id} completed",
            )
        )

    oracle = PeftOracle(base, {n: lora_dirs[n] for n in ("sql-a", "sql-b")})
    tok = AutoTokenizer.from_pretrained(base)
    eos = {int(tok.eos_token_id)}
    want = {
        (name, p): _greedy(oracle, tok, eos, None if name == "demo" else name, p)
        for name in ("sql-a", "sql-b", "demo")
        for p in PROMPTS
    }
    assert len({want[(n, PROMPTS[0])] for n in ("sql-a", "sql-b", "demo")}) == 3
    for batch, name in zip(done, ("sql-a", "sql-b", "demo"), strict=True):
        assert batch.model == name
        assert batch.request_counts.completed == 2 * len(PROMPTS)
        rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        for i, row in enumerate(rows):
            body = row["response"]["body"]
            assert body["model"] == name
            assert body["choices"][0]["text"] == want[(name, PROMPTS[i % len(PROMPTS)])]
    assert online.model == "sql-a"
    assert online.choices[0].text == want[("sql-a", PROMPTS[0])]
    assert streamed == want[("sql-b", PROMPTS[1])]

    # Heartbeats and /readyz show the adapters the worker holds.
    ready = svc.wait(
        lambda: (
            (r := httpx.get(svc.api_url + "/readyz", headers=METRICS, timeout=5).json())["adapters"]
            .get("sql-a", {})
            .get("loaded_on")
            and r
        ),
        what="readyz shows sql-a loaded",
    )
    assert ready["adapters"]["sql-b"]["base"] == "demo"
    assert ready["models"]["sql-a"] == ready["models"]["demo"] == 1

    # Removed: the API refuses it, and so does the worker once it synced.
    out = svc.cli("adapters", "remove", "sql-b")
    assert out.returncode == 0, out.stderr

    def refused() -> bool:
        try:
            client.completions.create(model="sql-b", prompt="x", max_tokens=2)
        except Exception as exc:
            return getattr(exc, "status_code", None) == 404
        return False

    svc.wait(refused, timeout=30, what="sql-b refused")
    assert worker.popen.poll() is None  # the same worker throughout: no restart
