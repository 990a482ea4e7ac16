"""Adapters by name: looked up and read off the loop, kept while they exist.

`request(name)` returns a Future of the adapter's weights: read by a thread of its own
the first time (the engine admits the line once it is done, as it waits for a grammar),
at once after that. Where an adapter lives comes from `source` (the worker's: the model
registry and the adapters added at run time, catalog/) or from `register` (tests and
embedded use). `sync` is told every name that exists now (the worker's heartbeat): an
adapter removed or changed is forgotten, so the next line of that name looks it up
again, and a removed one's lines are refused. A failed read is kept until then too
(a broken folder is not read again for every line).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from batchwright.adapter_files import AdapterError
from batchwright.engine.lora.weights import AdapterWeights, load_adapter

Source = Callable[[str], Path | None]


class AdapterMissing(AdapterError):
    """No adapter of that name for this base model."""


class AdapterStore:
    def __init__(self, model: str, shapes: dict[str, tuple[int, int]], max_rank: int) -> None:
        self.model = model
        self.shapes = shapes
        self.max_rank = max_rank
        self.source: Source | None = None
        self._static: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Path | None, Future[AdapterWeights]]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"lora-{model}")

    def register(self, name: str, folder: Path) -> None:
        """Serve `name` from `folder` (beside whatever the source knows)."""
        with self._lock:
            self._static[name] = Path(folder)
            self._entries.pop(name, None)

    def request(self, name: str) -> Future[AdapterWeights]:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                future: Future[AdapterWeights] = self._pool.submit(self._load, name)
                self._entries[name] = (None, future)
                return future
            return entry[1]

    def _load(self, name: str) -> AdapterWeights:
        with self._lock:
            folder = self._static.get(name)
        if folder is None and self.source is not None:
            folder = self.source(name)
        if folder is None:
            raise AdapterMissing(
                f"The model '{name[:200]}' does not exist here (not an adapter of '{self.model}')."
            )
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                self._entries[name] = (folder, entry[1])
        return load_adapter(name, folder, self.shapes, self.max_rank)

    def sync(self, current: Mapping[str, Path]) -> list[tuple[str, str]]:
        """Forget adapters that no longer exist or moved (`current`: every adapter of
        this model now, by name); returns the keys of loaded ones forgotten."""
        gone: list[tuple[str, str]] = []
        with self._lock:
            for name, (folder, future) in list(self._entries.items()):
                if name in self._static:
                    continue
                now = current.get(name)
                failed = future.done() and future.exception() is not None
                if now is None or failed or (folder is not None and Path(now) != folder):
                    del self._entries[name]
                    if future.done() and future.exception() is None:
                        gone.append(future.result().key)
        return gone

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted(
                n for n, (_, f) in self._entries.items() if f.done() and f.exception() is None
            )
