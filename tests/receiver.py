"""A real HTTP webhook receiver on loopback, answering from a script of status codes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    url: str
    # Status codes for the first requests, then 200.
    script: list[int] = field(default_factory=list)
    requests: list[Received] = field(default_factory=list)
    # While set, requests are held open (a slow receiver) until it is cleared.
    hold: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, n: int, timeout: float = 120) -> list[Received]:
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.requests) >= n, timeout):
                raise TimeoutError(f"{len(self.requests)} of {n} webhook requests arrived")
            return list(self.requests)


@contextmanager
def receiver(script: list[int] | None = None) -> Iterator[Receiver]:
    state = Receiver(url="", script=list(script or []))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            headers = {k.lower(): v for k, v in self.headers.items()}
            if state.hold.is_set():
                with state.arrived:
                    state.requests.append(Received(headers, body, 0))
                    state.arrived.notify_all()
                state.release.wait(120)
                return  # the sender is gone by now; nothing to answer
            with state.arrived:
                code = state.script.pop(0) if state.script else 200
                state.requests.append(Received(headers, body, code))
                state.arrived.notify_all()
            self.send_response(code)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
