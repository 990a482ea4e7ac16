"""SSE chunks of a streamed chat completion (`chat.completion.chunk`), from the relay's
events.

The engine streams a chat request as it streams any completion (text deltas, completion
logprobs); this writer turns them into OpenAI's chat chunks: per choice a first chunk
whose delta has the role, then content deltas (with `logprobs.content` entries when
asked), then one chunk with an empty delta and the finish_reason; with
`stream_options.include_usage` every chunk has `usage: null` and a last one before
`[DONE]` has `choices: []` and the usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchwright.online.chunks import DONE, sse
from batchwright.protocol.chat import chat_id
from batchwright.relay.messages import ChoiceDelta, Delta, OnlineRequest


def token_bytes(token: str) -> list[int]:
    """A logprobs token's bytes: `bytes:\\xNN...` keys carry them, text is UTF-8."""
    if token.startswith("bytes:"):
        return list(bytes.fromhex(token[len("bytes:") :].replace("\\x", "")))
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(logprobs: dict[str, Any] | None, k: int) -> list[dict[str, Any]]:
    """Completion-shaped logprobs of some tokens as chat `logprobs.content` entries."""
    if not logprobs:
        return []
    out = []
    tops = logprobs.get("top_logprobs") or []
    for i, (token, lp) in enumerate(
        zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], strict=False)
    ):
        top = tops[i] if i < len(tops) and tops[i] else {}
        best = sorted(top.items(), key=lambda t: -t[1])[:k]
        out.append(
            {
                "token": token,
                "logprob": lp,
                "bytes": token_bytes(token),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": token_bytes(t)} for t, v in best
                ],
            }
        )
    return out


@dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class ChatChunkWriter:
    request: OnlineRequest
    include_usage: bool
    system_fingerprint: str | None = None
    choices: dict[int, _Sent] = field(default_factory=dict)
    tokens: int = 0  # generated tokens seen in deltas (metrics)

    @property
    def _k(self) -> int:
        return int(self.request.body.get("top_logprobs") or 0)

    @property
    def _logprobs(self) -> bool:
        return bool(self.request.body.get("logprobs"))

    def _chunk(self, choice: dict[str, Any] | None) -> bytes:
        chunk: dict[str, Any] = {
            "id": chat_id(self.request.id),
            "object": "chat.completion.chunk",
            "created": self.request.created,
            "model": self.request.model,
            "choices": [] if choice is None else [choice],
        }
        if self.system_fingerprint:
            chunk["system_fingerprint"] = self.system_fingerprint
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _content(self, index: int, text: str, entries: list[dict[str, Any]]) -> list[bytes]:
        sent = self.choices.setdefault(index, _Sent())
        out = []
        if not sent.started:
            sent.started = True
            role = {"role": "assistant", "content": ""}
            out.append(self._chunk({"index": index, "delta": role, "logprobs": None,
                                    "finish_reason": None}))  # fmt: skip
        if text or entries:
            sent.chars += len(text)
            sent.tokens += len(entries)
            logprobs = {"content": entries, "refusal": None} if self._logprobs else None
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                      "finish_reason": None}  # fmt: skip
            out.append(self._chunk(choice))
        return out

    def _finish(self, index: int, reason: str) -> bytes:
        self.choices.setdefault(index, _Sent()).finished = True
        return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})

    def delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for choice in delta.choices:
            out.extend(self._choice(choice))
        return out

    def _choice(self, choice: ChoiceDelta) -> list[bytes]:
        index = choice["index"]
        sent = self.choices.get(index)
        if sent is not None and sent.finished:
            return []
        self.tokens += len(choice.get("token_ids") or [])
        lps = choice.get("logprobs")
        logprobs = dict(lps) if lps else None
        out = self._content(index, choice["text"], chat_logprobs(logprobs, self._k))
        finish = choice.get("finish_reason")
        if finish is not None:
            out.append(self._finish(index, finish))
        return out

    def done(self, completion: dict[str, Any]) -> list[bytes]:
        """The end: what the deltas left of each choice (from the chat completion, so the
        stream adds up to it), its finish chunk, the usage chunk if asked for, [DONE]."""
        out: list[bytes] = []
        for choice in completion.get("choices") or []:
            index = int(choice["index"])
            sent = self.choices.get(index, _Sent())
            if sent.finished:
                continue
            rest = str((choice.get("message") or {}).get("content") or "")[sent.chars :]
            entries = ((choice.get("logprobs") or {}).get("content") or [])[sent.tokens :]
            out.extend(self._content(index, rest, entries))
            out.append(self._finish(index, str(choice.get("finish_reason") or "stop")))
        if self.include_usage:
            chunk: dict[str, Any] = {
                "id": chat_id(self.request.id),
                "object": "chat.completion.chunk",
                "created": self.request.created,
                "model": self.request.model,
                "choices": [],
                "usage": completion.get("usage"),
            }
            if self.system_fingerprint:
                chunk["system_fingerprint"] = self.system_fingerprint
            out.append(sse(chunk))
        out.append(DONE)
        return out

    @staticmethod
    def error(error: dict[str, Any]) -> list[bytes]:
        return [sse({"error": error}), DONE]
