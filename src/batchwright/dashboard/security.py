"""Response headers that keep the dashboard's pages to themselves: no framing (the batch
page has a cancel button), no script or style from anywhere but the dashboard, and no
content-type sniffing on any response."""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchwright.dashboard.auth import PATH

POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",  # the live pages re-fetch themselves
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "content-security-policy": POLICY,
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        page = scope["path"] == PATH or scope["path"].startswith(PATH + "/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("x-content-type-options", "nosniff")
                if page:
                    for name, value in PAGE_HEADERS.items():
                        headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
