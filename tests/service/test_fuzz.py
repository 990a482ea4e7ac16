"""Schema-driven fuzzing of the live API: nothing the OpenAPI document admits (or, in
negative mode, breaks) may produce a 5xx. Bounded by example counts: a few minutes at most."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
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


# Alphabets the schema does not reach: lone surrogates (valid JSON escapes, not valid
# UTF-8), integers past int64 and multipart boundaries past the parser's limit.
_text = st.text(st.characters(codec=None), max_size=24) | st.sampled_from(
    ["\ud800", "file-\udfff", "\udbff24h", "\x00", "/v1/completions", "24h", "file-abc"]
)
_huge = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [2**31 - 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]
)
_value = st.recursive(
    st.none() | st.booleans() | _huge | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def _batch_body(file_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies around a real input file, so that a bad value reaches the database."""
    known = st.sampled_from([file_id, "/v1/completions", "24h"])
    return st.fixed_dictionaries(
        {"input_file_id": st.just(file_id) | _text, "endpoint": known | _text,
         "completion_window": known | _text},
        optional={
            "metadata": st.dictionaries(_text, _text | _huge, max_size=4) | _value,
            "output_expires_after": st.fixed_dictionaries({"anchor": _text, "seconds": _huge}),
            "unknown": _value,
        },
    ) | st.dictionaries(_text, _value, max_size=4)  # fmt: skip


def _no_5xx(response: Any) -> None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_hostile_batch_bodies(api_url: str, api_key: str) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=api_url, headers=headers, timeout=30) as http:
        upload = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": '
                   b'"/v1/completions", "body": {"model": "demo", "prompt": "x"}}\n')},
            data={"purpose": "batch"},
        )  # fmt: skip
        file_id = upload.json()["id"]
        ok = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}

        @given(body=_batch_body(file_id))
        @example(body={**ok, "input_file_id": "file-\ud800"})
        @example(body={**ok, "metadata": {"k": "\udfff"}})
        @example(body={**ok, "metadata": {"\ud800": "v"}})
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(body: dict[str, Any]) -> None:
            # ensure_ascii writes a lone surrogate as its "\ud800" escape, as a client would.
            resp = http.post(
                "/v1/batches",
                content=json.dumps(body, ensure_ascii=True),
                headers={"content-type": "application/json"},
            )
            _no_5xx(resp)
            if resp.status_code == 200:  # nobody will run it
                http.post(f"/v1/batches/{resp.json()['id']}/cancel")

        check()


def test_hostile_multipart_boundaries(api_url: str, api_key: str) -> None:
    boundary_chars = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"')
    with httpx.Client(
        base_url=api_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ) as http:

        @given(
            boundary=st.text(boundary_chars, min_size=1, max_size=400)
            | st.integers(min_value=200, max_value=2000).map(lambda n: "b" * n),
            filename=_text,
        )
        @example(boundary="b" * 257, filename="a.jsonl")
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(boundary: str, filename: str) -> None:
            name = filename.encode("utf-8", "replace")  # header bytes: no surrogates
            body = (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
                + name.replace(b'"', b"")
                + b'"\r\n\r\n{"custom_id": "a"}\r\n'
                + f"--{boundary}--\r\n".encode()
            )
            content_type = f'multipart/form-data; boundary="{boundary}"'
            _no_5xx(http.post("/v1/files", content=body, headers={"content-type": content_type}))

        check()
