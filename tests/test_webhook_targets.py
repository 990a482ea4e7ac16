"""Which webhook URLs are refused without WEBHOOK_ALLOW_PRIVATE_TARGETS (no services)."""

from __future__ import annotations

import time

import pytest

from batchwright.errors import InvalidRequest
from batchwright.webhooks.outbox import payload
from batchwright.webhooks.signing import new_secret, sign
from batchwright.webhooks.targets import check_url


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
        "http://0.0.0.0/x",
    ],
)
def test_private_targets_refused(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_url(url, allow_private=False)
    assert info.value.param == "url"
    assert check_url(url, allow_private=True) == url


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "http:///nohost"])
def test_non_http_refused_even_when_private_allowed(url: str) -> None:
    with pytest.raises(InvalidRequest):
        check_url(url, allow_private=True)


def test_public_address_allowed() -> None:
    assert check_url("https://93.184.215.14/hook", allow_private=False)


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
