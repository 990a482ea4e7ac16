"""Watching an engine without changing it (`Engine.observe`): the worker's metrics time its
forwards, the embedded run counts its results for the progress line."""

from __future__ import annotations

from batchwright.engine.requests.types import GenResult


class Observer:
    """Override what you watch; called on the engine's thread, so keep it short."""

    def forward(self, seconds: float, prompt_tokens: int) -> None:
        """One forward of the model in a step (decode rows and any prompts prefilled)."""

    def finished(self, result: GenResult) -> None:
        """A result the engine hands out (before the wire object is built)."""
