"""The README's openai SDK example runs as written against the service the suite starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_sdk_example(api_url: str, api_key: str, worker: Any, tmp_path: Path) -> None:
    done = _run_example("/v1/completions", api_url, api_key, tmp_path)
    printed = [ln.split(" ", 1)[0] for ln in done.stdout.splitlines() if ln.startswith("q")]
    assert printed == [f"q{i}" for i in range(10)]


def test_readme_chat_schema_example(
    api_url: str, api_key: str, worker: Any, tmp_path: Path
) -> None:
    done = _run_example("/v1/chat/completions", api_url, api_key, tmp_path)
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("city-")]
    # Lines that stopped printed their parsed JSON; the demo model finishes some in 80 tokens.
    assert rows and all("'country': " in row for row in rows), done.stdout


def _run_example(
    endpoint: str, api_url: str, api_key: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    [example] = [b for b in blocks if f'endpoint="{endpoint}"' in b]
    code = example.replace("http://127.0.0.1:8000/v1", api_url + "/v1").replace(
        '"sk-bw-..."', repr(api_key)
    )
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


def test_readme_service_and_cli_blocks_as_written(bw_home: Path, tmp_path: Path) -> None:
    """The "By hand" block, then the command-line block, run by bash line for line. Only
    what must differ on a shared machine is replaced: the database's name, the Redis
    database and a queue of its own, the port, and the key and batch id the earlier
    commands printed."""
    import psycopg

    from tests.conftest import PG_ADMIN, REDIS, _free_port

    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    [service] = [b for b in blocks if "createdb" in b and "serve --port 8000 &" in b]
    [client] = [b for b in blocks if "batches submit" in b]
    name, port = f"bw_readme_{uuid.uuid4().hex[:8]}", _free_port()
    host = PG_ADMIN.rsplit("/", 1)[0]
    cli = str(Path(sys.executable).with_name("batchwright"))

    def adapt(block: str) -> str:
        return (
            block.replace("postgresql://postgres@127.0.0.1:5432/batchwright", f"{host}/{name}")
            .replace("-U postgres batchwright", f"-U postgres {name}")
            .replace("redis://127.0.0.1:6379/0", REDIS)
            .replace("8000", str(port))
            .replace(".venv/bin/batchwright", cli)
        )

    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHWRIGHT_", "OPENAI_"))}
    env |= {"BATCHWRIGHT_HOME": str(bw_home), "BATCHWRIGHT_QUEUE": f"readme-{name}"}
    setup, _, check = adapt(service).partition("curl ")
    script = tmp_path / "service.sh"
    script.write_text("set -e\n" + setup)
    log = (tmp_path / "service.log").open("w")
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=README.parent,
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        key = next(ln.strip() for ln in proc.stdout if ln.startswith("sk-bw-"))
        # The block's last line asks /readyz: ok once the database and broker answer. Its
        # per-model capacity needs the metrics key, so the worker's heartbeat is waited
        # for on /v1/models, with the key the block printed.
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 300
        while True:
            ready = subprocess.run(["bash", "-c", "curl " + check], capture_output=True,
                                   text=True)  # fmt: skip
            if '"status":"ok"' in ready.stdout:  # the API listens
                auth = {"Authorization": f"Bearer {key}"}
                models = httpx.get(f"{base}/v1/models", headers=auth).json()
                if any(m["id"] == "demo" and m.get("live_workers") for m in models["data"]):
                    break
            assert time.monotonic() < end, (ready.stdout, (tmp_path / "service.log").read_text())
            time.sleep(1)

        lines = [ln for ln in adapt(client).splitlines() if ln.strip()]
        # The same shell as the service block (`keys list` reads its database export).
        service_exports = "\n".join(ln for ln in setup.splitlines() if ln.startswith("export "))
        exports = service_exports + "\n" + lines[0].replace("sk-bw-...", key)
        (tmp_path / "examples").mkdir()
        example = README.parent / "examples" / "completions.jsonl"
        (tmp_path / "examples" / "completions.jsonl").write_bytes(example.read_bytes())
        outputs: dict[str, subprocess.CompletedProcess[str]] = {}
        batch_id = ""
        for command in lines[1:]:
            command = command.replace("BATCH_ID", batch_id)
            done = subprocess.run(["bash", "-c", f"{exports}\n{command}"], env=env,
                                  cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300)  # fmt: skip
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr
            # "batches submit", "models list", "complete Once" …
            outputs[" ".join(command.split(cli, 1)[1].split()[:2])] = done
            if "batches submit" in command:
                batch_id = re.findall(r"batch_\w+", done.stdout)[0]
        assert "completed" in outputs["batches submit"].stdout
        saved = (tmp_path / "out.jsonl").read_text().splitlines()
        assert [json.loads(x)["custom_id"] for x in saved] == [f"request-{i}" for i in range(1, 9)]
        assert batch_id in outputs["batches list"].stdout
        assert "live workers" in outputs["models list"].stdout
        assert "32 completion tokens" in outputs['complete "Once'].stderr
        assert "my-team" in outputs["keys list"].stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
