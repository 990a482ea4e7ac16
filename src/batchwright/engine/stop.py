"""Stop-sequence detection on decoded text, so a stop string may span token boundaries."""

from __future__ import annotations

from collections.abc import Callable


class StopChecker:
    """Finds the earliest stop sequence in a row's generated text as tokens arrive.

    The text grows incrementally, the way HF's and vLLM's incremental detokenizers do it:
    each step decodes only the tokens since the last complete piece, with that piece as
    context, and keeps the difference. Decoding a token alone is not safe (a SentencePiece
    decoder drops the leading space of the first token; a byte-level token can be part of
    a UTF-8 character): with the context both decodes start alike. Trailing replacement
    characters ("\ufffd": an incomplete UTF-8 character) are held back until the bytes
    that follow settle them; everything before them is final. So the text searched is
    `decode(ids)` without its trailing "\ufffd", the returned index is an index into
    `decode(ids)`, and each step costs the new tokens, not the whole text.
    """

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = stops
        self.decode = decode
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""  # the final part of decode(ids) so far
        self.prefix = 0  # ids[prefix:read]: the last complete piece, decoded as context
        self.read = 0
        self.held = 0  # characters past the context already in `text` (before a settle)
        self.searched = 0  # text length already searched for a complete match

    def check(self, ids: list[int]) -> int | None:
        """Index in the decoded text where the earliest stop sequence starts, if any."""
        if not self.stops:
            return None
        context = self.decode(ids[self.prefix : self.read])
        window = self.decode(ids[self.prefix :])
        new = window.rstrip("\ufffd")[len(context) + self.held :]
        self.text += new
        self.held += len(new)
        if not window.endswith("\ufffd"):
            self.prefix, self.read, self.held = self.read, len(ids), 0
        if not new:
            return None
        start = max(0, self.searched - self.longest + 1)
        self.searched = len(self.text)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None


def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop sequence, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
