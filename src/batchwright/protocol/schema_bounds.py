"""Bounds on a `response_format` JSON schema, checked before anything else looks at it.

The metaschema check (jsonschema) and the grammar compile (llguidance) both take time in
proportion to a schema, or worse: a 0.6 MB schema of 15,000 properties held the API's
event loop 5.5 s, its compile took 14.7 s and then panicked, and 100 levels of
`properties` raised RecursionError. So a schema is measured first, by one walk without
recursion, against bounds near OpenAI's own for structured outputs (5,000 properties,
1,000 enum values): a schema past one is a 400 that names it, and no check runs on it.
Values inside the schema (`default`, `const`, `examples`) count for depth and size too.
"""

from __future__ import annotations

from typing import Any

import orjson

# Containers (objects and arrays, schema keywords included) nested in one another.
MAX_DEPTH = 48
# The schema as compact JSON.
MAX_BYTES = 256 * 1024
# Objects anywhere in the schema (each subschema is one): a bound on the grammar's size.
MAX_NODES = 5_000
# Property names over all `properties` objects (OpenAI: 5,000).
MAX_PROPERTIES = 5_000
# Values over all `enum` arrays (OpenAI: 1,000).
MAX_ENUM_VALUES = 1_000


def schema_bounds_error(schema: Any) -> str | None:
    """Why `schema` is past a bound (the 400's text), or None."""
    try:
        size = len(orjson.dumps(schema))  # C speed, before a walk in Python
    except TypeError:  # deeper than orjson writes (or not JSON): the walk says which
        size = 0
    if size > MAX_BYTES:
        return f"the schema is {size} bytes as JSON, over the limit of {MAX_BYTES}"
    nodes = properties = enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"the schema nests deeper than {MAX_DEPTH} levels"
        if isinstance(value, dict):
            nodes += 1
            if nodes > MAX_NODES:
                return f"the schema has more than {MAX_NODES} objects (subschemas)"
            props = value.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > MAX_PROPERTIES:
                    return f"the schema has more than {MAX_PROPERTIES} properties in all"
            enum = value.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
                if enums > MAX_ENUM_VALUES:
                    return f"the schema has more than {MAX_ENUM_VALUES} enum values in all"
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return None
