"""The README's openai SDK example runs as written against the service the suite starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
