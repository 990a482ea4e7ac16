"""The worker, by the process each part runs in.

- `generation/`: the generation process, a Celery worker serving its models' queues: the
  engine hosts (one engine loop per model), the online pump, the `process` task's body.
- `lease_child/`: the lease child beside it: claims, lease renewals, cancels, result
  writes (run in threads of the generation process where there is no child).
- `service.py` (any Celery worker process's start and stop: heartbeat, metrics, engine
  hosts) and `supervisor.py` (the companion processes: control worker, sweeper).
- Shared by those processes: `stats.py` (the process's counters and its heartbeat
  thread), `metrics.py` (its Prometheus metrics), `adapters.py` (LoRA adapters).

What the services import of work and workers (dispatch, routing, heartbeat readers,
budgets) is the control plane, `batchwright.controlplane`, below both.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Old paths of moved modules, for callers not yet moved (tests/faults' fixtures and
# batches/validation.py, whose owners move their imports): `from batchwright.worker
# import runner` answers the module itself, so patching it patches the real one.
# Remove once nothing imports these names from here (issue 31).
_MOVED = {
    "dispatch": "batchwright.controlplane.dispatch",
    "heartbeat": "batchwright.controlplane.heartbeats",
    "runner": "batchwright.worker.generation.runner",
}


def __getattr__(name: str) -> ModuleType:
    if name in _MOVED:
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
