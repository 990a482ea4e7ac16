"""`batchwright run` on an embeddings file: no servers, progress, and an interrupted run
that continues where it stopped (lines done before are not embedded again)."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import numpy as np
import pytest

from batchwright.runs.state import RunState
from tests.embed.test_accuracy import close
from tests.test_run_resume import _env, _interrupt, _output, _run, _saved_completions


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from batchwright.engine.embed.tiny import build_encoder

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return build_encoder(tmp_path_factory.mktemp("run_embed") / "enc")


def _lines(n: int) -> str:
    words = ["the", "sea", "and", "the", "mountains", "rivers", "people"]
    words += ["small", "towns", "along", "coast"]
    out = []
    for i in range(n):
        text = " ".join(words[(i + j) % len(words)] for j in range(3 + i % 40))
        body = {"model": "enc", "input": [text, f"line {i}"] if i % 3 == 0 else text}
        out.append(
            json.dumps(
                {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            )
        )
    return "\n".join(out) + "\n"


def _vectors(out: list[dict[str, object]]) -> np.ndarray:
    rows = []
    for o in out:
        body = o["response"]["body"]  # type: ignore[index]
        rows += [d["embedding"] for d in body["data"]]  # type: ignore[index]
    return np.array(rows, dtype=np.float32)


def test_embeddings_file_runs_and_resumes(bw_home: Path, encoder: Path, tmp_path: Path) -> None:
    env = _env(bw_home, tmp_path / "tmp")
    env["BATCHWRIGHT_MODELS"] = json.dumps(
        {"models": {"enc": {"path": str(encoder), "max_batch_tokens": 256}}}
    )
    # More lines than the run can hold finished but unwritten (result_queue_size, 256,
    # twice over: one write of that many, as many more waiting) plus a forward's and a
    # claim's worth, so an interrupt leaves lines to do however fast the engine.
    n = 800
    text = _lines(n)
    reference, src = tmp_path / "reference.jsonl", tmp_path / "big.jsonl"
    reference.write_text(text)
    src.write_text(text)
    done = _run(reference, env)
    assert done.returncode == 0, done.stderr
    ref = _output(tmp_path / "reference.output.jsonl")
    assert [o["custom_id"] for o in ref] == [f"e{i}" for i in range(n)]
    usage = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in ref)  # type: ignore[index]
    assert f"{usage} input + 0 output" in done.stdout

    code, err = _interrupt(src, env, at_least=16, sig=signal.SIGINT)
    assert code == 130, err
    saved = _saved_completions(RunState(bw_home, src).database)
    assert 16 <= len(saved) < n
    again = _run(src, env)
    assert again.returncode == 0, again.stderr
    assert f"continuing: {len(saved)} of {n} lines already done" in again.stderr
    out = _output(tmp_path / "big.output.jsonl")
    assert [o["custom_id"] for o in out] == [f"e{i}" for i in range(n)]
    # Packed with other inputs in the two runs: equal to rounding.
    close(_vectors(out), _vectors(ref))
