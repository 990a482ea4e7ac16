"""Which URLs a webhook may be sent to: http(s) only, and no private or loopback addresses
unless the operator allows them (a webhook must not become a way into the local network)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from batchwright.errors import InvalidRequest


def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidRequest(f"Cannot resolve webhook host {host!r}: {exc}", param="url") from exc
    return [ipaddress.ip_address(info[4][0]) for info in infos]


def check_url(url: str, *, allow_private: bool) -> str:
    """The URL if it may be used, else InvalidRequest saying why. Checked again on every
    delivery, since a name can resolve elsewhere later."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(
            f"Invalid webhook URL {url[:200]!r}: use an http:// or https:// URL.",
            param="url",
            code="invalid_url",
        )
    if allow_private:
        return url
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for addr in _addresses(parts.hostname, port):
        if not addr.is_global:
            raise InvalidRequest(
                f"Webhook URL {url[:200]!r} points at {addr}, a private, loopback or reserved "
                "address; set BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS=true to allow it.",
                param="url",
                code="invalid_url",
            )
    return url
