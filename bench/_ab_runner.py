"""One side of bench/ab.py: loads one revision's engine and runs one request set.

Run as `python _ab_runner.py JOB.json` with PYTHONPATH naming that revision's `src`; it
imports only the engine's stable entry points (`Engine.load(spec)`, `engine.run(reqs)`,
`GenRequest`, `ModelSpec`), trying the layout after issue 31 first and the flat one
after, so any revision of either layout can be measured. It prints one JSON object.

The job: {"model": dir, "spec": {ModelSpec fields}, "warmup": [bodies], "bodies":
[bodies], "wall_cpus": [cpu ids] or [], "runs": times the bodies run, one after the
other (default 1)}. The process is started pinned to one core
(taskset); it runs on one torch thread, timed in CPU-seconds of the process; then, if
`wall_cpus` is given, once more on those cores with as many threads, timed by the clock.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import resource
import sys
import time
from typing import Any


def _first(candidates: list[tuple[str, str]]) -> Any:
    """The first of (module, attribute) that imports; a module missing is the only
    failure taken as "not this layout" (any other error inside it is raised)."""
    for module, attr in candidates:
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue
            raise
        if hasattr(found, attr):
            return getattr(found, attr)
    raise ImportError(f"none of {candidates} found")


def _digest(completion: dict[str, Any] | None) -> str:
    if completion is None:
        return ""
    texts = [
        c.get("text") or (c.get("message") or {}).get("content") or ""
        for c in completion["choices"]
    ]
    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()[:12]


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    engine_cls = _first(
        [
            ("batchwright.engine.engine", "Engine"),
            ("batchwright.engine", "Engine"),
            ("batchwright.engine.runtime", "Engine"),
        ]
    )
    gen_request = _first(
        [
            ("batchwright.engine.requests.types", "GenRequest"),
            ("batchwright.engine.requests", "GenRequest"),
            ("batchwright.engine.types", "GenRequest"),
        ]
    )
    model_spec = _first([("batchwright.registry", "ModelSpec")])
    import batchwright

    spec = model_spec(name="bench", path=job["model"], **job["spec"])
    engine = engine_cls.load(spec)
    # Where the wire objects are built outside the engine (batchwright/serving), the
    # texts are compared from those; before that, `run` built them itself.
    try:
        serve = _first([("batchwright.serving.lines", "serve")])
    except ImportError:
        serve = None

    def results(reqs: list[Any]) -> Any:
        return serve(engine, reqs) if serve is not None else engine.run(reqs)

    def run(bodies: list[dict[str, Any]]) -> tuple[int, float, float, dict[str, str]]:
        reqs = [gen_request(i, b) for i, b in enumerate(bodies)]
        texts: dict[str, str] = {}
        tokens = 0
        cpu, wall = time.process_time(), time.perf_counter()
        for res in results(reqs):
            if res.status_code != 200:
                raise RuntimeError(f"request {res.key}: {res.error}")
            tokens += res.completion_tokens
            texts[str(res.key)] = _digest(res.completion)
        return tokens, time.process_time() - cpu, time.perf_counter() - wall, texts

    run(job["warmup"])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tokens, cpu_s, wall_s = 0, 0.0, 0.0
    for _ in range(job.get("runs", 1)):  # a worker's consecutive files, in one process
        got, cpu, wall, texts = run(job["bodies"])
        tokens, cpu_s, wall_s = tokens + got, cpu_s + cpu, wall_s + wall
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {
        "src": os.path.dirname(os.path.dirname(batchwright.__file__)),
        "tokens": tokens,
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "tok_per_cpu_s": tokens / cpu_s,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "minor_faults": usage.ru_minflt - faults,
        "texts": texts,
    }
    cpus = job.get("wall_cpus") or []
    if cpus:
        os.sched_setaffinity(0, set(cpus))
        torch.set_num_threads(len(cpus))
        tokens2, _, wall2, _ = run(job["bodies"])
        out["wall_threads"] = len(cpus)
        out["wall2_s"] = wall2
        out["tok_per_wall2_s"] = tokens2 / wall2
    print(json.dumps(out))


if __name__ == "__main__":
    main()
