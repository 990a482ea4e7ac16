"""The /v1/embeddings request and response, as the official SDK models them. Torch-free:
the API and batch validation check bodies with it; the worker builds responses with it.

`check_embedding_body` turns a body into an `EmbeddingRequest` or an OpenAI error object
naming the parameter (and the input's index). What needs the model (each input within its
context, `dimensions` among its Matryoshka sizes) the worker checks: engine/embed/inputs.py.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from batchwright.protocol.sampling import (
    CheckedRequest,
    describe,
    locate,
    request_error,
    show,
    union_detail,
)

# OpenAI's limits (embeddings guide and API reference): inputs per request, tokens summed
# over a request's inputs, inputs summed over a batch file's lines.
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
MAX_BATCH_INPUTS = 50_000

# fail_fast: a list of a million wrong items is one error (protocol/completions.py says why).
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Strings = Annotated[list[str], Field(fail_fast=True)]
InputType = str | Strings | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]


class EmbeddingRequest(CheckedRequest):
    """A body for /v1/embeddings (an online request or a batch line's). Its check and the
    messages of its errors are the completion and chat requests' (protocol/sampling.py),
    but for `input` (one message for its four shapes) and `encoding_format`."""

    PARAMS = ("model", "input", "encoding_format", "dimensions", "user")

    model: str
    input: InputType
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v: InputType) -> InputType:
        if isinstance(v, str):
            if not v:
                raise ValueError("'input' cannot be an empty string")
            return v
        if not v:
            raise ValueError("'input' cannot be an empty array")
        if isinstance(v[0], int):
            if any(t < 0 for t in v):
                raise ValueError("token ids must be non-negative")
            return v
        if len(v) > MAX_INPUTS:
            raise ValueError(f"{len(v)} inputs, over the maximum of {MAX_INPUTS} per request")
        for i, item in enumerate(v):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input[{i}] is an empty string; inputs must not be empty")
            elif not item:
                raise ValueError(f"input[{i}] is an empty array of token ids")
            elif any(t < 0 for t in item):  # type: ignore[operator]
                raise ValueError(f"input[{i}] holds a negative token id")
        return v

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, one per embedding returned (a single string or token array is one)."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if isinstance(v[0], int):
            return [v]
        return v

    @property
    def input_count(self) -> int:
        v = self.input
        return 1 if isinstance(v, str) or isinstance(v[0], int) else len(v)

    @classmethod
    def _explain(cls, errors: list[Any]) -> tuple[str, str | None]:
        first = errors[0]
        if tuple(first.get("loc", ()))[:1] == ("input",) and first.get("type") != "missing":
            return (
                "Invalid 'input': expected a non-empty string, an array of strings, an array "
                f"of token ids or an array of token-id arrays ({union_detail(errors)}).",
                "input",
            )
        if first.get("type") == "literal_error":
            where, param = locate(first)
            return (
                f"Invalid '{where}': {show(first.get('input'))}; expected 'float' or 'base64'.",
                param,
            )
        return describe(first)


# Validate a body: (request, None) or (None, OpenAI error object); `max_sequences` and the
# keywords of CheckedRequest.check do not apply to embeddings.
check_embedding_body = EmbeddingRequest.check


def input_error(index: int | None, message: str, code: str | None = None) -> dict[str, Any]:
    """A 400 about one input (`index` None: the request's only input)."""
    where = "input" if index is None else f"input[{index}]"
    return request_error(f"Invalid '{where}': {message}", "input", code)


# --- the response ------------------------------------------------------------------------


def encode_vector(vector: Any, encoding_format: str) -> Any:
    """One embedding as it goes on the wire. `vector`: a float32 numpy array. Floats stay
    an array that orjson writes (`dumps` below: float32's shortest decimal form), base64
    is its little-endian float32 bytes, which the SDK decodes with numpy or struct."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector


def embedding_body(
    model: str, vectors: Sequence[Any], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    """The CreateEmbeddingResponse: a list object with one embedding per input, in order."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def is_embedding_body(body: dict[str, Any]) -> bool:
    return body.get("object") == "list"
