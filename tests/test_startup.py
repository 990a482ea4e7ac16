"""Starting `batchwright` (issue 22, item 4): the CLI does not import the openai SDK (only
the client's commands use it), and those commands are all still there."""

from __future__ import annotations

import os
import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    return subprocess.run(
        [sys.executable, "-m", "batchwright.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_importing_the_cli_leaves_the_sdk_and_torch_out() -> None:
    code = (
        "import sys\n"
        "import batchwright.cli\n"
        "print(','.join(m for m in ('openai', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported with the CLI: {done.stdout.strip()}"


def test_client_commands_are_all_there() -> None:
    listed = _cli("--help")
    assert listed.returncode == 0, listed.stderr
    for group in ("run", "files", "batches", "models", "keys"):
        assert f" {group} " in listed.stdout
    for args, sub in ((("files",), "upload"), (("batches",), "submit"), (("models",), "list")):
        shown = _cli(*args, "--help")
        assert shown.returncode == 0 and f" {sub} " in shown.stdout, shown.stdout + shown.stderr
    assert " list " in _cli("keys", "--help").stdout
    # A client command runs through the SDK as before: no key, one clear line, exit 1.
    no_key = _cli("models", "list")
    assert no_key.returncode == 1 and "no API key" in no_key.stderr, no_key.stderr
