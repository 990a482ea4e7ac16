"""How one token is written in logprobs: its text, or `bytes:\\xNN...` for byte fragments.

A byte-level tokenizer has tokens that are pieces of one UTF-8 character; each decodes on
its own to "\\ufffd", so keyed by text, distinct tokens would collapse into one entry of
`top_logprobs` (and the chosen token's entry could vanish). Such tokens are written as
OpenAI writes them: "bytes:" and each byte as a `\\xNN` escape (lowercase hex), in
`tokens` and as `top_logprobs` keys alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves,
    the others are shifted past U+0100 (the table every ByteLevel tokenizer uses)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(0x100 + shifted)] = b
            shifted += 1
    return chars


def _has_byte_level_decoder(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


class TokenKeys:
    def __init__(self, tokenizer: Any, decode: Callable[[list[int]], str]) -> None:
        self._tok = tokenizer
        self._decode = decode
        self._byte_level = _has_byte_level_decoder(tokenizer)
        self._unbyte = _byte_level_alphabet()
        self.text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(self._text)
        self.key: Callable[[int], str] = lru_cache(maxsize=1 << 16)(self._key)

    def _text(self, token: int) -> str:
        """The token decoded on its own (what text_offset counts)."""
        return self._decode([token])

    def _key(self, token: int) -> str:
        text = self.text(token)
        if "\ufffd" not in text:
            return text
        raw = self.raw_bytes(token)
        if raw is None:
            return text
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text  # a token that really is U+FFFD

    def raw_bytes(self, token: int) -> bytes | None:
        """The token's bytes, when the tokenizer says what they are."""
        piece = self._tok.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return None
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if self._byte_level and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        return None
