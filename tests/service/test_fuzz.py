"""Schema-driven fuzzing of the live API: nothing the OpenAPI document admits (or, in
negative mode, breaks) may produce a 5xx. Bounded by example counts: a few minutes at most."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

EXAMPLES = 80


def _operations(api_url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(api_url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_server_errors(api_url: str, api_key: str, worker: Any, mode: Any) -> None:
    failures: list[str] = []
    for operation in _operations(api_url):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            response = case.call(headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
            assert response.status_code < 500, (
                case.method,
                case.formatted_path,
                response.text[:300],
            )
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        try:
            check()
        except AssertionError as exc:
            failures.append(f"{operation.label}: {exc}")
        except Unsatisfiable:
            continue  # nothing to break: an operation without parameters in negative mode
    assert not failures, "\n".join(failures)
