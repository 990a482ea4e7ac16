"""The engine hosts of a worker's generation process: one per served model, started when
the worker is ready, each loading its model in its own thread (worker/generation/engine_host.py)."""

from __future__ import annotations

import threading

from batchwright.config import Settings
from batchwright.controlplane.routing import served_models
from batchwright.registry import load_registry
from batchwright.worker.generation import lease_process, runner
from batchwright.worker.generation.engine_host import EngineHost
from batchwright.worker.generation.pump import start_pump

_hosts: dict[str, EngineHost] = {}
_lock = threading.Lock()


def start(settings: Settings) -> list[str]:
    """A host per model this worker serves (none for a control-only worker); each takes
    online requests from the relay once its model loaded. Returns the models."""
    registry = load_registry(settings)
    models = served_models(settings, registry)
    with _lock:
        for model in models:
            spec = registry.get(model)
            if spec is None or model in _hosts:
                continue
            host = EngineHost(
                model,
                lambda spec=spec: runner.engine_for(spec),  # type: ignore[misc]
                orders_ahead=lease_process.wanted(settings),
                online=lambda h: start_pump(h, settings),
            )
            _hosts[model] = host
            host.start()
    return models


def get(model: str) -> EngineHost | None:
    """The model's host once it loaded (None: no host here, or its model failed to load;
    the lease then runs in a host of its own: runner.host_for)."""
    with _lock:
        host = _hosts.get(model)
    if host is None:
        return None
    host.loaded.wait()
    return host if host.engine is not None else None


def stop_all() -> None:
    """Worker shutdown: no more online requests; each loop ends once what it holds ends."""
    with _lock:
        hosts = list(_hosts.values())
        _hosts.clear()
    for host in hosts:
        host.stop()
