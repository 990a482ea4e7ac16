"""Workers starting together build the demo model once, and none loads a half-built one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import sys
from batchwright.engine.loading.loader import load_model
from batchwright.registry import ModelSpec
lm = load_model(ModelSpec(name="demo", path=sys.argv[1]))
print("loaded", lm.vocab_size)
"""


def test_concurrent_first_use_builds_once(tmp_path: Path) -> None:
    path = tmp_path / "models" / "demo"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:]
        assert "loaded" in out
    assert (path / "config.json").exists()
    # No build folders left behind: each build went to its own folder, renamed into place.
    assert sorted(x.name for x in path.parent.iterdir() if not x.name.endswith(".lock")) == ["demo"]
