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
        # A LoRA adapter's line answers as the adapter, its fingerprint the adapter's too.
        model, fingerprint = engine.model_name, engine.system_fingerprint
        if job.adapter is not None and job.lora is not None:
            model = job.adapter
            fingerprint = job.lora.result().fingerprint(fingerprint)
        if job.endpoint == CHAT:
            result.completion = build_chat_completion(
                job,
                model=model,
                fingerprint=fingerprint,
                decode=text.decode,
                tok=text.token_text,
                piece=text.token_piece,
                raw=text.raw_bytes,
            )
        else:
            result.completion = build_completion(
                job,
                model=model,
                fingerprint=fingerprint,
                decode=text.decode,
                tok=text.token_text,
                piece=text.token_piece,
            )
        return result
