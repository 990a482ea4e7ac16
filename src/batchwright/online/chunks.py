"""SSE chunks of a streamed completion or chat completion, built from the relay's events.

One writer (`ChunkWriter`) keeps what each choice has been sent and writes the stream's
frame: every chunk has the request's `id`, `created` and `model` and one choice; each
choice ends with one finish chunk (its deltas' or, where they stopped short, the rest of the
final object's); with `stream_options.include_usage` every chunk has `usage: null` and the
last one before `[DONE]` has `choices: []` and the usage. Each endpoint's writer says what a
choice's content and finish chunks hold:

- `CompletionChunkWriter` (`text_completion`): a choice's text arrives as chunks with its
  `token` (the last generated token the chunk's text completes; null for the echoed
  prompt), then one chunk with `text: ""` and its `finish_reason` — the seed's shape.
- `ChatChunkWriter` (`chat.completion.chunk`, online/chat_chunks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from batchwright.relay.messages import ChoiceDelta, Delta, OnlineRequest

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass
class Sent:
    """What one choice has been sent."""

    chars: int = 0  # text sent so far (echo included)
    tokens: int = 0  # logprob entries sent so far
    started: bool = False  # chat: its first chunk (the role) is out
    finished: bool = False


@dataclass
class ChunkWriter:
    request: OnlineRequest
    include_usage: bool
    system_fingerprint: str | None = None
    choices: dict[int, Sent] = field(default_factory=dict)
    # Generated tokens seen in deltas (metrics count them as they come).
    tokens: int = 0

    OBJECT: ClassVar[str]

    @property
    def id(self) -> str:
        return self.request.id

    def chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> bytes:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.OBJECT,
            "created": self.request.created,
            "model": self.request.model,
            "choices": [] if choice is None else [choice],
        }
        if self.system_fingerprint:
            out["system_fingerprint"] = self.system_fingerprint
        if self.include_usage:
            out["usage"] = usage
        return sse(out)

    def delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for choice in delta.choices:
            index = choice["index"]
            sent = self.choices.get(index)
            if sent is not None and sent.finished:
                continue  # one finish chunk per choice, whatever a worker repeats
            self.tokens += len(choice.get("token_ids") or [])
            out.extend(self._delta_content(index, choice))
            finish = choice.get("finish_reason")
            if finish is not None:
                out.append(self._finish(index, finish))
        return out

    def done(self, completion: dict[str, Any]) -> list[bytes]:
        """The end: each choice the deltas left unfinished gets the rest of its content and
        its finish chunk (from the final object, so the stream always adds up to it), then
        the usage chunk if asked for, then [DONE]."""
        out: list[bytes] = []
        for choice in completion.get("choices") or []:
            index = int(choice["index"])
            sent = self.choices.get(index, Sent())
            if sent.finished:
                continue
            out.extend(self._rest(index, choice, sent))
            out.append(self._finish(index, str(choice.get("finish_reason") or "stop")))
        if self.include_usage:
            out.append(self.chunk(None, completion.get("usage")))
        out.append(DONE)
        return out

    @staticmethod
    def error(error: dict[str, Any]) -> list[bytes]:
        return [sse({"error": error}), DONE]

    def _finish(self, index: int, reason: str) -> bytes:
        self.choices.setdefault(index, Sent()).finished = True
        return self.chunk(self._finish_choice(index, reason))

    # What each endpoint's chunks hold.

    def _delta_content(self, index: int, choice: ChoiceDelta) -> list[bytes]:
        """The content chunks of one choice's delta."""
        raise NotImplementedError

    def _rest(self, index: int, choice: dict[str, Any], sent: Sent) -> list[bytes]:
        """The content chunks of what the final object's choice holds past `sent`."""
        raise NotImplementedError

    def _finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionChunkWriter(ChunkWriter):
    OBJECT = "text_completion"

    def _delta_content(self, index: int, choice: ChoiceDelta) -> list[bytes]:
        text, ids = choice["text"], choice.get("token_ids") or []
        if not (text or ids):
            return []
        logprobs = choice.get("logprobs")
        return [
            self._text(index, text, ids[-1] if ids else None, dict(logprobs) if logprobs else None)
        ]

    def _rest(self, index: int, choice: dict[str, Any], sent: Sent) -> list[bytes]:
        rest = str(choice.get("text") or "")[sent.chars :]
        logprobs = _tail(choice.get("logprobs"), sent.tokens)
        return [self._text(index, rest, None, logprobs)] if rest or logprobs else []

    def _text(self, index: int, text: str, token: int | None, logprobs: Any) -> bytes:
        sent = self.choices.setdefault(index, Sent())
        sent.chars += len(text)
        if logprobs is not None:
            sent.tokens += len(logprobs.get("tokens") or [])
        choice = {
            "index": index,
            "text": text,
            "token": token,
            "finish_reason": None,
            "logprobs": logprobs,
        }
        return self.chunk(choice)

    def _finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "text": "", "finish_reason": reason, "logprobs": None}


def _tail(logprobs: dict[str, Any] | None, start: int) -> dict[str, Any] | None:
    if not logprobs or len(logprobs.get("tokens") or []) <= start:
        return None
    return {key: list(value or [])[start:] for key, value in logprobs.items()}
