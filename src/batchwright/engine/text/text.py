"""A model's token ids as text: what detokenising, stops, logprobs and deltas read."""

from __future__ import annotations

from typing import Any

from batchwright.engine.text.stop import GrowingText, IncrementalText, StreamText
from batchwright.engine.text.token_keys import TokenKeys

__all__ = ["GrowingText", "Text"]


class Text:
    """The tokenizer's side of a loaded model, shared by the request preparer, the output
    processor and whoever builds wire objects from a finished job."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._keys = TokenKeys(tokenizer, self.decode)

    def decode(self, ids: list[int]) -> str:
        return str(
            self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def token_text(self, token: int) -> str:
        """The token as logprobs write it (`bytes:\\xNN` for byte fragments)."""
        return self._keys.key(token)

    def token_piece(self, token: int) -> str:
        """The token decoded on its own (what `text_offset` counts)."""
        return self._keys.text(token)

    def raw_bytes(self, token: int) -> bytes | None:
        """The token's bytes, when the tokenizer says what they are."""
        return self._keys.raw_bytes(token)

    def text_stream(self) -> GrowingText:
        """A growing text for streamed deltas: the tokenizer's own incremental decoder
        when it has one (a fast tokenizer), else IncrementalText over `decode`."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            try:
                return StreamText(backend)
            except ImportError:  # tokenizers before DecodeStream (0.21)
                pass
        return IncrementalText(self.decode)
