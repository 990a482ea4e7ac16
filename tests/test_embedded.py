"""`batchwright run FILE.jsonl`: no servers, SQLite, the demo model built on first use."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "completions.jsonl"


def _run(path: Path, home: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env["BATCHWRIGHT_HOME"] = str(home)
    env.update({f"BATCHWRIGHT_{k.upper()}": v for k, v in settings.items()})
    return subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "run", str(path), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_example_file(tmp_path: Path) -> None:
    src = tmp_path / "completions.jsonl"
    shutil.copy(EXAMPLE, src)
    home = tmp_path / "home"
    done = _run(src, home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (home / "models" / "demo" / "config.json").exists()  # built on first use
    # It says what it builds without promising a time, and then how long the build took.
    said = done.stderr.splitlines()
    assert said[0].startswith("building the demo model"), done.stderr
    assert not re.search(r"about \d+ ?s", said[0]), said[0]
    assert any(re.fullmatch(r"built the demo model in \d+ s", line) for line in said), said
    requests = [json.loads(x) for x in src.read_text().splitlines()]
    out = [json.loads(x) for x in (tmp_path / "completions.output.jsonl").read_text().splitlines()]
    assert not (tmp_path / "completions.errors.jsonl").exists()
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in requests]
    total_in = total_out = 0
    for req, o in zip(requests, out, strict=True):
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "demo"
        assert len(body["choices"]) == req["body"].get("n", 1)
        total_in += body["usage"]["prompt_tokens"]
        total_out += body["usage"]["completion_tokens"]
    assert "completed" in done.stdout
    assert f"{total_in} input + {total_out} output" in done.stdout


def test_run_with_bad_lines(tmp_path: Path) -> None:
    src = tmp_path / "mixed.jsonl"
    good = {
        "custom_id": "ok",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": "hi", "max_tokens": 3},
    }
    bad = {**good, "custom_id": "bad", "body": {**good["body"], "temperature": 7}}
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    done = _run(src, tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    errs = [json.loads(x) for x in (tmp_path / "mixed.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errs] == ["bad"]
    assert errs[0]["response"]["body"]["error"]["param"] == "temperature"


def test_run_invalid_file_fails_with_line_numbers(tmp_path: Path) -> None:
    src = tmp_path / "broken.jsonl"
    src.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        '"body": {"model": "demo", "prompt": "x"}}\nnot json\n'
    )
    done = _run(src, tmp_path / "home")
    assert done.returncode == 1
    assert "line 2" in done.stdout and "invalid_json_line" in done.stdout


def test_run_line_over_the_limit(tmp_path: Path) -> None:
    src = tmp_path / "long.jsonl"
    body = {"model": "demo", "prompt": "x" * 500}
    src.write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body})
    )
    done = _run(src, tmp_path / "home", max_line_bytes="200")
    assert done.returncode == 1
    assert "line 1" in done.stdout and "line_too_long" in done.stdout


def test_run_chat_file_with_a_schema(tmp_path: Path) -> None:
    # A chat batch file in OpenAI's shape, with a JSON schema: `batchwright run` takes the
    # endpoint from the lines' url.
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": f"Question {i}?"}],
                "max_completion_tokens": 40,
                "temperature": 0,
                **({"response_format": fmt} if i % 2 else {}),
            },
        }
        for i in range(6)
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = _run(src, tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    out = [json.loads(x) for x in (tmp_path / "chat.output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    parsed = []
    for i, o in enumerate(out):
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        choice = body["choices"][0]
        if i % 2:
            assert choice["finish_reason"] == "stop"  # a few tokens of JSON, well within 40
            parsed.append(json.loads(choice["message"]["content"]))
    assert all(p["answer"] in ("yes", "no") and 0 <= p["score"] <= 9 for p in parsed)


def test_run_reuses_a_shared_prefix_by_default(tmp_path: Path) -> None:
    """No registry setting: lines that share a long prefix report it as cached tokens."""
    head = "You are a careful assistant. Answer in one short sentence, plainly. " * 6
    src = tmp_path / "shared.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"q{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "demo", "prompt": head + f"Item {i}:", "max_tokens": 2},
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    done = _run(src, tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    out = [json.loads(x) for x in (tmp_path / "shared.output.jsonl").read_text().splitlines()]
    cached = [o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
    assert sum(1 for c in cached if c > 0) >= 5, cached


# `batchwright run` in a subprocess, its `runner.process` calls (the work slices) recorded.
_SLICED = """
import sys
from batchwright import cli
from batchwright.worker.generation import runner

landed = []
process = runner.process


def counted(*args, **kwargs):
    landed.append(process(*args, **kwargs))
    return landed[-1]


runner.process = counted
try:
    cli.app(["run", sys.argv[1], "--quiet"], standalone_mode=False)
finally:
    print("SLICES", *landed, file=sys.stderr)
"""


def test_later_work_slices_find_the_prefixes_of_earlier_ones(tmp_path: Path) -> None:
    """Device state outlives a run: a file done in three work slices (one claim of four
    lines each) gets prefix hits in slices two and three from the cache slice one filled,
    so only the very first line computes the shared prefix."""
    head = "You are a careful assistant. Answer in one short sentence, plainly. " * 6
    src = tmp_path / "sliced.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"q{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "demo", "prompt": head + f"Item {i}:", "max_tokens": 2},
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env.update(
        BATCHWRIGHT_HOME=str(tmp_path / "home"),
        BATCHWRIGHT_CLAIM_BATCH_SIZE="4",
        BATCHWRIGHT_WORK_SLICE_SECONDS="0",  # a slice ends after its one claim
    )
    done = subprocess.run(
        [sys.executable, "-c", _SLICED, str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    slices = re.search(r"^SLICES(.*)$", done.stderr, re.M)
    assert slices is not None, done.stderr
    assert [int(n) for n in slices.group(1).split() if n != "0"] == [4, 4, 4], slices.group(0)
    out = [json.loads(x) for x in (tmp_path / "sliced.output.jsonl").read_text().splitlines()]
    cached = {
        o["custom_id"]: o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        for o in out
    }
    assert len(cached) == 12
    # Without the cache kept, the first line of each slice would compute the prefix again.
    assert [k for k, c in cached.items() if c == 0] == ["q0"], cached
