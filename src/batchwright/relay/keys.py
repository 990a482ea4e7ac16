"""Redis key names of the relay, namespaced by `Settings.queue` (test runs share one Redis).

- `pending:{model}` list: requests waiting for a worker; LPUSH in, taken from the right,
  so a request handed back (RPUSH) is the next one taken.
- `bell:{model}` list: one ring per submit; idle workers block on the bells of all their
  models at once (BLMPOP), then take from the pending lists (a Lua script).
- `taken:{worker}` list: requests a worker holds, moved there atomically from `pending`.
- `worker:{worker}` string with a TTL: the worker is alive while it exists.
- `serving:{model}` set: workers that announced the model (dead ones are reaped out).
- `events:{request}` stream: the request's events, worker to API.
- `cancel:{request}` string with a TTL: the API gave the request up.
- `requeues:{request}` counter: times a dead worker's request went back to `pending`.
- `limits:{model}` string with a TTL: what the model's workers announce of it (its
  context length, its vocabulary's longest token in bytes) for the API's checks.
- `reader:{id}` stream with a TTL: rings an API process's event reader (reader.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelayKeys:
    queue: str

    @property
    def prefix(self) -> str:
        return f"{self.queue}:online"

    def pending(self, model: str) -> str:
        return f"{self.prefix}:pending:{model}"

    def bell(self, model: str) -> str:
        return f"{self.prefix}:bell:{model}"

    def taken(self, worker: str) -> str:
        return f"{self.prefix}:taken:{worker}"

    def worker(self, worker: str) -> str:
        return f"{self.prefix}:worker:{worker}"

    def serving(self, model: str) -> str:
        return f"{self.prefix}:serving:{model}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{request_id}"

    def requeues(self, request_id: str) -> str:
        return f"{self.prefix}:requeues:{request_id}"

    def limits(self, model: str) -> str:
        return f"{self.prefix}:limits:{model}"
