"""SSE chunks of a streamed completion, built from the relay's events.

Every chunk has the request's `id`, `created` and `model`, and one choice. A choice's text
arrives as chunks with its `token` (the last generated token the chunk's text completes;
null for the echoed prompt), then one chunk with `text: ""` and its `finish_reason` — the
seed's shape. With `stream_options.include_usage` every chunk has `usage: null` and the
last one before `[DONE]` has `choices: []` and the Completion's usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from batchwright.relay.messages import ChoiceDelta, Delta, OnlineRequest

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass
class _Sent:
    chars: int = 0  # text sent so far (echo included)
    tokens: int = 0  # logprob entries sent so far
    finished: bool = False


@dataclass
class ChunkWriter:
    request: OnlineRequest
    include_usage: bool
    system_fingerprint: str | None = None
    choices: dict[int, _Sent] = field(default_factory=dict)
    # Generated tokens seen in deltas (metrics count them as they come).
    tokens: int = 0

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request.id,
            "object": "text_completion",
            "created": self.request.created,
            "model": self.request.model,
            "choices": [] if choice is None else [choice],
        }
        if self.system_fingerprint:
            chunk["system_fingerprint"] = self.system_fingerprint
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _text(self, index: int, text: str, token: int | None, logprobs: Any) -> bytes:
        sent = self.choices.setdefault(index, _Sent())
        sent.chars += len(text)
        if logprobs is not None:
            sent.tokens += len(logprobs.get("tokens") or [])
        return sse(
            self._chunk(
                {
                    "index": index,
                    "text": text,
                    "token": token,
                    "finish_reason": None,
                    "logprobs": logprobs,
                }
            )
        )

    def _finish(self, index: int, reason: str) -> bytes:
        self.choices.setdefault(index, _Sent()).finished = True
        choice = {"index": index, "text": "", "finish_reason": reason, "logprobs": None}
        return sse(self._chunk(choice))

    def delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for choice in delta.choices:
            out.extend(self._choice(choice))
        return out

    def _choice(self, choice: ChoiceDelta) -> list[bytes]:
        out: list[bytes] = []
        index, text = choice["index"], choice["text"]
        sent = self.choices.get(index)
        if sent is not None and sent.finished:
            return out  # one finish chunk per choice, whatever a worker repeats
        ids = choice.get("token_ids") or []
        self.tokens += len(ids)
        if text or ids:
            token = ids[-1] if ids else None
            logprobs = choice.get("logprobs")
            out.append(self._text(index, text, token, dict(logprobs) if logprobs else None))
        finish = choice.get("finish_reason")
        if finish is not None:
            out.append(self._finish(index, finish))
        return out

    def done(self, completion: dict[str, Any]) -> list[bytes]:
        """The end: each choice the deltas left unfinished gets the rest of its text and its
        finish chunk (from the Completion, so the stream always adds up to it), then the
        usage chunk if asked for, then [DONE]."""
        out: list[bytes] = []
        for choice in completion.get("choices") or []:
            index = int(choice["index"])
            sent = self.choices.get(index, _Sent())
            if sent.finished:
                continue
            rest = str(choice.get("text") or "")[sent.chars :]
            logprobs = _tail(choice.get("logprobs"), sent.tokens)
            if rest or logprobs:
                out.append(self._text(index, rest, None, logprobs))
            out.append(self._finish(index, str(choice.get("finish_reason") or "stop")))
        if self.include_usage:
            chunk = self._chunk(None)
            chunk["usage"] = completion.get("usage")
            out.append(sse(chunk))
        out.append(DONE)
        return out

    @staticmethod
    def error(error: dict[str, Any]) -> list[bytes]:
        return [sse({"error": error}), DONE]


def _tail(logprobs: dict[str, Any] | None, start: int) -> dict[str, Any] | None:
    if not logprobs or len(logprobs.get("tokens") or []) <= start:
        return None
    return {key: list(value or [])[start:] for key, value in logprobs.items()}
