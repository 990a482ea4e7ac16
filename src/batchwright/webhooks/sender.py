"""POST a webhook to the address that was checked, not to whatever the name says next.

Checking a URL and then letting an HTTP client resolve its name again leaves a gap: a name
that answered with a public address for the check can answer 127.0.0.1 for the connection
(DNS rebinding). httpcore takes a network backend; ours resolves the name once, refuses the
lot if any address is private (unless allowed), and connects to a checked address. The URL,
and with it the Host header and TLS server name, stays the name.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpcore

from batchwright.webhooks.targets import checked_addresses

# Bytes of a receiver's answer kept for the delivery's last_error; the rest is not read.
KEEP_BODY = 1024
FAILURES = (
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
)


class CheckedBackend(httpcore.SyncBackend):
    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = checked_addresses(host, port, allow_private=self.allow_private)
        deadline = None if timeout is None else time.monotonic() + timeout
        error: Exception = httpcore.ConnectError(f"{host!r} resolves to no address")
        for addr in addresses:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                return super().connect_tcp(str(addr), port, left, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    timeout: float,
    allow_private: bool,
) -> Answer:
    """One POST, no redirects followed, no proxy from the environment. Raises RefusedTarget
    for a private target, InvalidRequest for a name that does not resolve, and one of
    FAILURES when the receiver cannot be reached or answers garbage."""
    limits = {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
    backend = CheckedBackend(allow_private=allow_private)
    with (
        httpcore.ConnectionPool(network_backend=backend, max_connections=1) as pool,
        pool.stream(
            "POST", url, headers=list(headers.items()), content=body,
            extensions={"timeout": limits},
        ) as resp,
    ):  # fmt: skip
        kept = b""
        for chunk in resp.iter_stream():
            kept += chunk
            if len(kept) >= KEEP_BODY:
                break
        return Answer(resp.status, kept[:KEEP_BODY])
