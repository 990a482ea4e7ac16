"""Stop-sequence detection on decoded text, so a stop string may span token boundaries."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol


class GrowingText(Protocol):
    """A row's generated text as tokens arrive (IncrementalText, StreamText)."""

    text: str

    def update(self, ids: list[int]) -> str: ...


class IncrementalText:
    """A row's generated text as tokens arrive, decoding only the new ones.

    The way HF's and vLLM's incremental detokenizers do it: each update decodes the
    tokens since the last complete piece, with that piece as context, and keeps the
    difference. Decoding a token alone is not safe (a SentencePiece decoder drops the
    leading space of the first token; a byte-level token can be part of a UTF-8
    character): with the context both decodes start alike. Trailing replacement
    characters ("\ufffd": an incomplete UTF-8 character) are held back until the bytes
    that follow settle them; everything before them is final. So `text` is `decode(ids)`
    without its trailing "\ufffd", and each update costs the new tokens, not the whole
    text.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.text = ""  # the final part of decode(ids) so far
        self.prefix = 0  # ids[prefix:read]: the last complete piece, decoded as context
        self.read = 0
        self.held = 0  # characters past the context already in `text` (before a settle)
        self._context: tuple[int, int, str] = (0, 0, "")  # decode(ids[prefix:read]), kept

    def update(self, ids: list[int]) -> str:
        """Take in `ids` (the whole list so far); returns the text that became final."""
        at, to, context = self._context
        if (at, to) != (self.prefix, self.read):
            context = self.decode(ids[self.prefix : self.read])
            self._context = (self.prefix, self.read, context)
        window = self.decode(ids[self.prefix :])
        new = window.rstrip("\ufffd")[len(context) + self.held :]
        self.text += new
        self.held += len(new)
        if not window.endswith("\ufffd"):
            self.prefix, self.read, self.held = self.read, len(ids), 0
        return new


class StreamText:
    """IncrementalText's text for a fast tokenizer, through tokenizers' DecodeStream (the
    same algorithm, TGI's, in Rust, a token at a time): about 15x cheaper a token than two
    decodes through transformers (streaming.py's per-step deltas)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._seen = 0
        self.text = ""

    def update(self, ids: list[int]) -> str:
        new = []
        for token in ids[self._seen :]:
            piece = self._stream.step(self._tok, token)
            if piece:
                new.append(piece)
        self._seen = len(ids)
        out = "".join(new)
        self.text += out
        return out


@lru_cache(maxsize=256)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP's prefix function of `stop`: for each prefix, its longest proper border."""
    out = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = out[k - 1]
        if stop[i] == stop[k]:
            k += 1
        out[i] = k
    return tuple(out)


def _advance(stop: str, borders: tuple[int, ...], state: int, text: str) -> int:
    """The longest prefix of `stop` that ends the text, after `text` was appended to a
    text whose longest such prefix was `state` (a whole stop goes on as its border)."""
    for ch in text:
        if state == len(stop):
            state = borders[state - 1]
        while state and stop[state] != ch:
            state = borders[state - 1]
        if stop[state] == ch:
            state += 1
    return state


class StopChecker:
    """Finds the earliest stop sequence in a row's generated text as tokens arrive.

    The text grows incrementally (IncrementalText or StreamText), so the text searched is
    `decode(ids)` without its trailing "\ufffd", the returned index is an index into
    `decode(ids)`, and each step costs the new tokens, not the whole text. What to hold back
    of a streamed text (the end that may still become a stop) follows each stop with KMP's
    automaton over the new characters: linear in the text, where comparing every end of the
    text with every stop was quadratic in the stop's length each step.
    """

    def __init__(
        self,
        stops: list[str],
        decode: Callable[[list[int]], str],
        grow: Callable[[], GrowingText] | None = None,
    ) -> None:
        """`grow`: a growing text of the model's (text.py's `text_stream`: the tokenizer's
        DecodeStream where it has one, about 15x cheaper a token than IncrementalText's
        two decodes, and the same text); IncrementalText over `decode` without it."""
        self.stops = stops
        self.decode = decode
        self.grow = grow
        self.longest = max((len(s) for s in stops), default=0)
        self._text: GrowingText = grow() if grow is not None and stops else IncrementalText(decode)
        self.searched = 0  # text length already searched for a complete match
        self._states = [0] * len(stops)  # per stop: its longest prefix ending the text
        self._fed = 0  # characters of the text the automata have read

    @property
    def text(self) -> str:
        return self._text.text

    def check(self, ids: list[int]) -> int | None:
        """Index in the decoded text where the earliest stop sequence starts, if any."""
        if not self.stops:
            return None
        if not self._text.update(ids):
            return None
        text = self._text.text
        start = max(0, self.searched - self.longest + 1)
        self.searched = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` that may still become a stop sequence (the
        longest end of it that begins one)."""
        if len(text) < self._fed or text is not self._text.text:
            return _held(self.stops, [0] * len(self.stops), text)
        new = text[self._fed :]
        self._fed = len(text)
        if new:
            self._states = [
                _advance(s, _borders(s), st, new)
                for s, st in zip(self.stops, self._states, strict=True)
            ]
        pairs = zip(self.stops, self._states, strict=True)
        return max((_within(s, st, self.longest) for s, st in pairs), default=0)


def _within(stop: str, state: int, longest: int) -> int:
    """The longest end of the text that begins `stop`, at most `longest - 1` characters
    (a whole stop that long is a match, not something to hold back)."""
    return state if state < longest else _borders(stop)[state - 1]


def _held(stops: list[str], states: list[int], text: str) -> int:
    longest = max((len(s) for s in stops), default=0)
    out = 0
    for s, st in zip(stops, states, strict=True):
        out = max(out, _within(s, _advance(s, _borders(s), st, text), longest))
    return out


def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop sequence, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
