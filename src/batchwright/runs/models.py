"""The models a `batchwright run` file names, loaded before the run creates any state: a
model the engine refuses stops the run in one line (exit 2) with nothing left behind."""

from __future__ import annotations

from pathlib import Path

import orjson
from rich.console import Console

from batchwright.registry import load_registry
from batchwright.runs.builds import first_use_builds
from batchwright.runs.interrupt import Interrupt
from batchwright.runs.progress import RunView
from batchwright.runs.state import READ_BYTES
from batchwright.worker.generation import runner

# A batch uses one model; a file naming more fails validation anyway. Past this many
# distinct names the scan stops (validation reports the rest).
_MOST = 4


def named_models(path: Path) -> list[str]:
    """Registry models the lines' `body.model` name, in order of first use."""
    registry = load_registry()
    found: list[str] = []
    rest = b""
    with path.open("rb") as src:
        while chunk := src.read(READ_BYTES):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                name = _model(raw)
                if name is not None and name not in found and registry.get(name) is not None:
                    found.append(name)
                    if len(found) >= _MOST:
                        return found
    name = _model(rest)
    if name is not None and name not in found and registry.get(name) is not None:
        found.append(name)
    return found


def _model(raw: bytes) -> str | None:
    if b'"model"' not in raw:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None  # validation reports the line
    body = obj.get("body") if isinstance(obj, dict) else None
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def preload(path: Path, console: Console, interrupt: Interrupt, *, show_progress: bool) -> bool:
    """Load each model the file names (the run's worker then finds them loaded); raises
    ModelRefused for one the engine cannot serve. First-use builds are said and counted on
    the progress line, as the run says them. False: Ctrl-C stopped it (nothing is built
    half, no state exists yet)."""
    registry = load_registry()
    with RunView(console, enabled=show_progress) as view:
        for name in named_models(path):
            spec = registry.get(name)
            assert spec is not None
            with view.doing(f"loading {name}"):
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
                # Its advisories too (a masked-LM's "add is_decoder=True" on the way to a refusal):
                # the run's own line says what went wrong, and the loader refuses what matters.
                hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
                for build in [] if runner.loaded(name) else first_use_builds(spec):
                    if interrupt.requested.is_set():
                        return False  # the next build would only be cut short too
                    with view.building(build.what) as outcome:
                        outcome.built = build.run()
                        outcome.stopped = interrupt.requested.is_set()
                if interrupt.requested.is_set():
                    return False
                runner.engine_for(spec)
    return True
