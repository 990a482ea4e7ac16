"""`response_format`: plain text, any JSON object, or JSON matching a schema.

OpenAI takes it on /v1/chat/completions; batchwright takes the same object on
/v1/completions lines too (an extension). Torch-free: every reader checks the schema's
size (schema_bounds.py); the API and the validating worker (a validation context with
`check_schema`) also check that it is a JSON Schema; whether the grammar library can
compile it is the engine's call (engine/sampling/grammar.py), a 400 naming `response_format` too.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from batchwright.protocol.schema_bounds import schema_bounds_error

# OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64 characters.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    # `schema` shadows a BaseModel attribute: kept under another name, read by alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # True: objects take no properties beyond those listed (OpenAI's strict mode); False
    # or absent: as JSON Schema says (extra properties allowed unless the schema forbids
    # them). Either way the output follows the schema.
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError(
                "the name must be 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes"
            )
        return v

    @field_validator("schema_")
    @classmethod
    def _is_json_schema(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is None:
            return v
        # Bounds first: no check (nor later a compile) runs on a schema past them.
        error = schema_bounds_error(v)
        if error is None and info.context and info.context.get("check_schema"):
            # Against the metaschema where a body comes in (the API, a batch's validation);
            # the engine reads bodies checked there and leaves the rest to the grammar
            # compile, off its thread (engine/sampling/grammar.py).
            error = _schema_error(v)
        if error is not None:
            raise ValueError(error)
        return v


def _canonical(schema: dict[str, Any]) -> bytes:
    import orjson

    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)


def _check(schema: dict[str, Any]) -> str | None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"not a valid JSON Schema at {where}: {exc.message[:200]}"
    return None


# A dataset file repeats a few schemas on every line, and checking one against the
# metaschema costs milliseconds (as much as generating several tokens on CPU): each
# distinct schema is checked once, at validation and again where the engine reads the
# line. Kept by digest, so that large schemas are not held.
_CHECKED: OrderedDict[bytes, str | None] = OrderedDict()
_CHECKED_MAX = 256
_lock = threading.Lock()


def _schema_error(schema: dict[str, Any]) -> str | None:
    try:
        key = hashlib.blake2b(_canonical(schema), digest_size=16).digest()
    except TypeError:  # not JSON (a caller built the dict in Python): check it as is
        return _check(schema)
    with _lock:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return _CHECKED[key]
    error = _check(schema)
    with _lock:
        _CHECKED[key] = error
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    return error


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' goes with type 'json_schema', not {self.type!r}")
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    def grammar_key(self) -> tuple[str, str, bool] | None:
        """What the compiled grammar depends on: (kind, canonical schema, strict); None for
        text."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None:
            return ("json_object", "", False)
        schema = self.json_schema.schema_
        if schema is None:
            return ("json_object", "", False)
        return ("json_schema", _canonical(schema).decode(), bool(self.json_schema.strict))
