"""A JSON answer rendered by orjson: FastAPI deprecated its ORJSONResponse (a warning at
every first use), and the error envelopes and health bodies are plain dicts."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


class JSONBody(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
