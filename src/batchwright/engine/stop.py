"""Stop-sequence detection on decoded text, so a stop string may span token boundaries."""

from __future__ import annotations

from collections.abc import Callable


class StopChecker:
    """Finds the earliest stop sequence in a row's generated text as tokens arrive.

    The generated ids are decoded as a whole (a token can be a fragment of a UTF-8 character
    or merge with its neighbour), and only the tail that could contain a new match is searched.
    """

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = stops
        self.decode = decode
        self.longest = max((len(s) for s in stops), default=0)
        self.searched = 0  # text length already searched for a complete match

    def check(self, ids: list[int]) -> int | None:
        """Index in the decoded text where the earliest stop sequence starts, if any."""
        if not self.stops:
            return None
        text = self.decode(ids)
        start = max(0, self.searched - self.longest + 1)
        self.searched = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None


def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop sequence, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True
