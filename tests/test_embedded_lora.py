"""`batchwright run` with a registry adapter: a file of adapter lines runs on this machine
(SQLite, in-process worker), its results PEFT's for the same base and adapter."""

from __future__ import annotations

import json
from pathlib import Path

from tests.lora_models import PeftOracle, build_adapter
from tests.test_embedded import _run


def test_run_file_of_adapter_lines(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from batchwright.engine.loading.demo import build_demo_model

    home = tmp_path / "home"
    base = build_demo_model(home / "models" / "demo")
    adapter = build_adapter(
        base, tmp_path / "sql", r=8, targets=["q_proj", "down_proj"], alpha=16, seed=4
    )
    models = tmp_path / "models.toml"
    models.write_text(f'[models.sql]\nbase = "demo"\nadapter = "{adapter}"\n')
    prompts = ["Once upon a time", "The quick brown fox", "Numbers like 0 1"]
    src = tmp_path / "lines.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"q{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "sql", "prompt": p, "max_tokens": 8, "temperature": 0},
                }
            )
            + "\n"
            for i, p in enumerate(prompts)
        )
    )
    done = _run(src, home, models_file=str(models))
    assert done.returncode == 0, done.stdout + done.stderr
    out = [json.loads(x) for x in (tmp_path / "lines.output.jsonl").read_text().splitlines()]
    oracle = PeftOracle(base, {"sql": adapter})
    tok = AutoTokenizer.from_pretrained(base)
    eos = {int(tok.eos_token_id)}
    for p, o in zip(prompts, out, strict=True):
        body = o["response"]["body"]
        assert body["model"] == "sql"
        want = tok.decode(oracle.greedy(list(tok(p).input_ids), 8, "sql", eos))
        assert body["choices"][0]["text"] == want
