"""The wire object of each finished job the engine hands out, by the endpoint it came on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchwright.engine.requests.types import GenResult
from batchwright.protocol.endpoints import CHAT
from batchwright.serving.chat import build_chat_completion
from batchwright.serving.completions import build_completion

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine


class Wire:
    """`wire(result)`: the result with its `completion` built (a Completion or a
    chat.completion) and its job let go; results without a job pass unchanged."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, result: GenResult) -> GenResult:
        job = result.job
        if job is None:
            return result
        result.job = None
        engine = self.engine
        text = engine.text
        if job.endpoint == CHAT:
            result.completion = build_chat_completion(
                job,
                model=engine.model_name,
                fingerprint=engine.system_fingerprint,
                decode=text.decode,
                tok=text.token_text,
                piece=text.token_piece,
                raw=text.raw_bytes,
            )
        else:
            result.completion = build_completion(
                job,
                model=engine.model_name,
                fingerprint=engine.system_fingerprint,
                decode=text.decode,
                tok=text.token_text,
                piece=text.token_piece,
            )
        return result
