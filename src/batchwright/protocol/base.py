"""Base for wire models that mirror OpenAI objects (extra fields tolerated, as the SDK does)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")
