"""Which webhook URLs are refused without WEBHOOK_ALLOW_PRIVATE_TARGETS (no services)."""

from __future__ import annotations

import time
from ipaddress import IPv6Address

import pytest

from batchwright.errors import InvalidRequest
from batchwright.webhooks.outbox import payload
from batchwright.webhooks.signing import new_secret, sign
from batchwright.webhooks.targets import check_url, embedded_ipv4


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://localhost:8080/x",
        "http://10.0.0.5/x",
        "http://192.168.1.1/x",
        "http://172.16.0.1/x",
        "http://169.254.169.254/latest/meta-data",  # cloud metadata
        "http://[::1]/x",
        "http://[fd00::1]/x",
        "http://[fe80::1]/x",
        "http://0.0.0.0/x",
        "http://100.64.0.1/x",  # carrier-grade NAT
        "http://224.0.0.1/x",  # multicast
        # IPv6 addresses that carry a private IPv4 address (loopback in disguise):
        "http://[::127.0.0.1]:8499/",  # IPv4-compatible
        "http://[::10.0.0.1]/x",
        "http://[::ffff:127.0.0.1]/x",  # IPv4-mapped
        "http://[::ffff:169.254.169.254]/x",
        "http://[::ffff:0:127.0.0.1]/x",  # IPv4-translated (SIIT)
        "http://[64:ff9b::7f00:1]:8499/",  # NAT64 well-known prefix, 127.0.0.1
        "http://[64:ff9b::a00:1]/x",  # NAT64, 10.0.0.1
        "http://[64:ff9b::192.168.0.1]/x",
        "http://[64:ff9b:1::7f00:1]/x",  # local-use NAT64 (RFC 8215)
        "http://[64:ff9b:1:2::808:808]/x",
        "http://[2002:7f00:1::1]/x",  # 6to4 of 127.0.0.1
        "http://[2002:a9fe:a9fe::]/x",  # 6to4 of 169.254.169.254
        # Teredo: server 65.54.227.120, client 127.0.0.1 (stored XOR 0xffffffff)
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/x",
        # Teredo: server 10.0.0.1, client 8.8.8.8
        "http://[2001:0:a00:1:8000:63bf:f7f7:f7f7]/x",
    ],
)
def test_private_targets_refused(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_url(url, allow_private=False)
    assert info.value.param == "url"
    assert "private, loopback or reserved" in info.value.message
    assert check_url(url, allow_private=True) == url


@pytest.mark.parametrize(
    "address, carried",
    [
        ("::127.0.0.1", ["127.0.0.1"]),
        ("::ffff:127.0.0.1", ["127.0.0.1"]),
        ("64:ff9b::7f00:1", ["127.0.0.1"]),
        ("2002:7f00:1::1", ["127.0.0.1"]),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", ["65.54.227.120", "127.0.0.1"]),
        ("::1", []),
        ("2606:4700::1111", []),
    ],
)
def test_embedded_ipv4(address: str, carried: list[str]) -> None:
    assert [str(a) for a in embedded_ipv4(IPv6Address(address))] == carried


@pytest.mark.parametrize(
    "url",
    [
        "https://93.184.215.14/hook",
        "https://[2606:4700::1111]/hook",
        "http://[::ffff:93.184.215.14]/hook",  # the embedded IPv4 is public too
        "http://[64:ff9b::5db8:d70e]/hook",  # NAT64 of 93.184.215.14
        "http://[2002:5db8:d70e::1]/hook",  # 6to4 of 93.184.215.14
    ],
)
def test_public_address_allowed(url: str) -> None:
    assert check_url(url, allow_private=False) == url


@pytest.mark.parametrize(
    "url", ["ftp://example.com/x", "file:///etc/passwd", "http:///nohost", "http://[::1/x"]
)
def test_non_http_refused_even_when_private_allowed(url: str) -> None:
    with pytest.raises(InvalidRequest):
        check_url(url, allow_private=True)


def test_signature_is_standard_webhooks() -> None:
    from openai import OpenAI

    secret = new_secret()
    assert secret.startswith("whsec_")
    body = payload("evt_1", "batch.completed", 1, "batch_1")
    ts = int(time.time())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(ts),
               "webhook-signature": sign(secret, "msg_1", ts, body)}  # fmt: skip
    event = OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed"
