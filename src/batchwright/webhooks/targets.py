"""Which URLs a webhook may be sent to: http(s) only, and no private or loopback addresses
unless the operator allows them (a webhook must not become a way into the local network).

An IPv6 address is judged by its own range and by every IPv4 address it carries: mapped
(`::ffff:a.b.c.d`), compatible (`::a.b.c.d`), SIIT (`::ffff:0:a.b.c.d`), NAT64
(`64:ff9b::/96`), 6to4 (`2002::/16`) and Teredo (`2001::/32`, server and client). A translator
on the way turns those into the IPv4 address, so `[::127.0.0.1]` is loopback in disguise.
"""

from __future__ import annotations

import socket
from ipaddress import IPv4Address, IPv6Address, IPv6Network, ip_address
from urllib.parse import urlsplit

from batchwright.errors import InvalidRequest

Address = IPv4Address | IPv6Address

_COMPATIBLE = IPv6Network("::/96")  # deprecated IPv4-compatible addresses (RFC 4291)
_SIIT = IPv6Network("::ffff:0:0:0/96")  # IPv4-translated (RFC 2765)
_NAT64 = IPv6Network("64:ff9b::/96")  # the well-known NAT64 prefix (RFC 6052)
# RFC 8215: local-use NAT64 prefixes, which an operator's own translator serves. Where the
# IPv4 address sits inside depends on the prefix length the operator chose, so the whole
# range is refused rather than guessed at.
_LOCAL_NAT64 = IPv6Network("64:ff9b:1::/48")


class RefusedTarget(InvalidRequest):
    """A webhook target in a private, loopback or reserved network."""


def embedded_ipv4(addr: IPv6Address) -> list[IPv4Address]:
    """The IPv4 addresses an IPv6 address carries, for every form a translator honours."""
    low32 = IPv4Address(int(addr) & 0xFFFFFFFF)
    found: list[IPv4Address] = []
    if addr.ipv4_mapped is not None:
        found.append(addr.ipv4_mapped)
    if addr in _COMPATIBLE and int(addr) > 1:  # "::" and "::1" are IPv6's own
        found.append(low32)
    if addr in _SIIT or addr in _NAT64:
        found.append(low32)
    if addr.sixtofour is not None:
        found.append(addr.sixtofour)
    if addr.teredo is not None:
        found.extend(addr.teredo)  # (server, client): ipaddress undoes the client's XOR
    return found


def why_refused(addr: Address) -> str | None:
    """Why a webhook may not be sent to `addr` (the address at fault, named), or None if
    it and every IPv4 address it carries are public."""
    candidates: list[Address] = [addr]
    if isinstance(addr, IPv6Address):
        candidates = [*embedded_ipv4(addr), addr]
    for candidate in candidates:
        local_nat64 = isinstance(candidate, IPv6Address) and candidate in _LOCAL_NAT64
        if not candidate.is_global or candidate.is_multicast or local_nat64:
            where = str(candidate) if candidate is addr else f"{candidate} (inside {addr})"
            return f"{where}, a private, loopback or reserved address"
    return None


def resolve(host: str, port: int) -> list[Address]:
    """Every address `host` stands for now: the literal itself, or one DNS answer."""
    try:
        return [ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise InvalidRequest(f"Cannot resolve webhook host {host!r}: {exc}", param="url") from exc
    seen: dict[Address, None] = {}
    for info in infos:
        seen[ip_address(info[4][0])] = None
    return list(seen)


def checked_addresses(host: str, port: int, *, allow_private: bool) -> list[Address]:
    """`host` resolved once, each address checked: connect to these and nothing else, so a
    name that answers differently a moment later cannot slip past the check."""
    addresses = resolve(host, port)
    if not allow_private:
        for addr in addresses:
            why = why_refused(addr)
            if why is not None:
                raise RefusedTarget(
                    f"Webhook host {host[:200]!r} resolves to {why}; set "
                    "BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS=true to allow it.",
                    param="url",
                    code="invalid_url",
                )
    return addresses


def split_url(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL, or InvalidRequest."""
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme, parts.hostname, parts.port
    except ValueError:  # a bad port or an unclosed "[" of an IPv6 literal
        scheme, host, port = "", None, None
    if scheme not in ("http", "https") or not host:
        raise InvalidRequest(
            f"Invalid webhook URL {url[:200]!r}: use an http:// or https:// URL.",
            param="url",
            code="invalid_url",
        )
    return host, port or (443 if scheme == "https" else 80)


def check_url(url: str, *, allow_private: bool) -> str:
    """The URL if it may be registered, else InvalidRequest saying why. Delivery checks
    again, on the addresses it connects to (webhooks/connect.py)."""
    host, port = split_url(url)
    if not allow_private:
        checked_addresses(host, port, allow_private=False)
    return url
