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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from batchwright.protocol.sampling import show

# OpenAI's limits (embeddings guide and API reference): inputs per request, tokens summed
# over a request's inputs, inputs summed over a batch file's lines.
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
MAX_BATCH_INPUTS = 50_000

KNOWN_PARAMS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})

# fail_fast: a list of a million wrong items is one error (protocol/completions.py says why).
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Strings = Annotated[list[str], Field(fail_fast=True)]
InputType = str | Strings | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]


class EmbeddingRequest(BaseModel):
    """A body for /v1/embeddings (an online request or a batch line's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

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


def _error(message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


_TAGS = frozenset(
    {"str", "int", "list[str]", "list[int]", "list[list[int]]", "literal['float','base64']"}
)


def _describe(err: Any) -> tuple[str, str | None]:
    loc = [str(p)[:64] for p in err.get("loc", ()) if str(p) not in _TAGS]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    kind, value, ctx = err.get("type", ""), err.get("input"), err.get("ctx") or {}
    if kind == "missing":
        return f"Missing required parameter: '{where}'.", param
    if kind in ("greater_than_equal", "greater_than"):
        limit = ctx.get("ge", ctx.get("gt"))
        return f"Invalid '{where}': {show(value)} is less than the minimum of {limit}.", param
    if kind == "literal_error":
        return f"Invalid '{where}': {show(value)}; expected 'float' or 'base64'.", param
    if kind == "value_error":
        return f"Invalid '{where}': {ctx.get('error', err.get('msg', ''))}.", param
    return f"Invalid '{where}': {show(value)} is not valid ({err.get('msg', kind)}).", param


def check_embedding_body(body: object) -> tuple[EmbeddingRequest | None, dict[str, Any] | None]:
    """Validate a body: (request, None) or (None, OpenAI error object)."""
    if not isinstance(body, dict):
        return None, _error("The request body must be a JSON object.", None, "invalid_body")
    for key in body:
        if key not in KNOWN_PARAMS:
            return None, _error(f"Unrecognized request argument supplied: {key[:64]}", key[:64])
    # null means the default, as for completions (the SDK leaves unset fields out anyway).
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return EmbeddingRequest.model_validate(body), None
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        if tuple(first.get("loc", ()))[:1] == ("input",) and first.get("type") != "missing":
            detail = next(
                (
                    str((e.get("ctx") or {}).get("error", e.get("msg")))
                    for e in errors
                    if e.get("type") == "value_error"
                ),
                f"got {show(first.get('input'))}"[:200],
            )
            return None, _error(
                "Invalid 'input': expected a non-empty string, an array of strings, an array "
                f"of token ids or an array of token-id arrays ({detail}).",
                "input",
            )
        message, param = _describe(first)
        return None, _error(message, param)


def input_error(index: int | None, message: str, code: str | None = None) -> dict[str, Any]:
    """A 400 about one input (`index` None: the request's only input)."""
    where = "input" if index is None else f"input[{index}]"
    return _error(f"Invalid '{where}': {message}", "input", code)


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
