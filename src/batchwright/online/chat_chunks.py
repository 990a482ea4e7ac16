"""SSE chunks of a streamed chat completion (`chat.completion.chunk`), from the relay's
events.

The engine streams a chat request as it streams any completion (text deltas, completion
logprobs); this writer turns them into OpenAI's chat chunks: per choice a first chunk
whose delta has the role, then content deltas (with `logprobs.content` entries when
asked), then one chunk with an empty delta and the finish_reason. The frame (ids, the
usage chunk, [DONE], one finish per choice) is the completions writer's: online/chunks.py.
"""

from __future__ import annotations

from typing import Any

from batchwright.online.chunks import ChunkWriter, Sent
from batchwright.protocol.chat import chat_id
from batchwright.relay.messages import ChoiceDelta


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


class ChatChunkWriter(ChunkWriter):
    OBJECT = "chat.completion.chunk"

    @property
    def id(self) -> str:
        return chat_id(self.request.id)

    @property
    def _k(self) -> int:
        return int(self.request.body.get("top_logprobs") or 0)

    @property
    def _logprobs(self) -> bool:
        return bool(self.request.body.get("logprobs"))

    def _delta_content(self, index: int, choice: ChoiceDelta) -> list[bytes]:
        lps = choice.get("logprobs")
        return self._content(
            index, choice["text"], chat_logprobs(dict(lps) if lps else None, self._k)
        )

    def _rest(self, index: int, choice: dict[str, Any], sent: Sent) -> list[bytes]:
        rest = str((choice.get("message") or {}).get("content") or "")[sent.chars :]
        entries = ((choice.get("logprobs") or {}).get("content") or [])[sent.tokens :]
        return self._content(index, rest, entries)

    def _content(self, index: int, text: str, entries: list[dict[str, Any]]) -> list[bytes]:
        sent = self.choices.setdefault(index, Sent())
        out = []
        if not sent.started:
            sent.started = True
            role = {"role": "assistant", "content": ""}
            out.append(self.chunk({"index": index, "delta": role, "logprobs": None,
                                   "finish_reason": None}))  # fmt: skip
        if text or entries:
            sent.chars += len(text)
            sent.tokens += len(entries)
            logprobs = {"content": entries, "refusal": None} if self._logprobs else None
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                      "finish_reason": None}  # fmt: skip
            out.append(self.chunk(choice))
        return out

    def _finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
