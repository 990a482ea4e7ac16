"""Request preparation never raises: any JSON value in any body field ends as a job or a
400 that names a parameter, through validation and the model's preparer (serving/prepare.py)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from batchwright.batches.quotas import TokenCounter
from batchwright.config import Settings
from batchwright.engine.engine import Engine
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.protocol.completions import KNOWN_PARAMS, check_completion_body
from batchwright.registry import Registry
from batchwright.serving.prepare import preparer

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    # Integers at the edges of int64, and products of two that pass it (n x max_tokens).
    | st.sampled_from([2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63) - 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    # Lone surrogates included: valid JSON escapes ("\\ud800") that are not valid UTF-8.
    | st.text(st.characters(codec=None), max_size=12)
    # Strings that look like numbers to one check and not to another.
    | st.sampled_from(["²", "¹", "①", "٣", "0", "007", "1" * 5000, "-1", "1.5", " 1", "\x00"])
    | st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff"])
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
# Values the engine reads as numbers or token ids, at and around their edges.
_edgy = st.one_of(
    st.integers(min_value=-3, max_value=2000),
    st.floats(min_value=-1e-30, max_value=1e-30, allow_nan=False),
    st.lists(st.integers(min_value=0, max_value=1200), min_size=1, max_size=5),
    st.dictionaries(
        st.sampled_from(["0", "1", "999", "1000", "5000", "²", "①", "9" * 20]),
        st.floats(min_value=-150, max_value=150),
        max_size=3,
    ),
)
_fields = [*sorted(KNOWN_PARAMS), "unknown_field"]
COUNTER = TokenCounter(Registry(models={}), None)  # prompts counted at 4 bytes a token


def _deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


def _through_json(body: dict[str, Any]) -> Any:
    """What a worker sees: the line's bytes parsed as the validator parses them."""
    return orjson.loads(orjson.dumps(body))


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(changes=st.dictionaries(st.sampled_from(_fields), _json | _edgy, min_size=1, max_size=4))
@example(changes={"logit_bias": {"²": 1}})
@example(changes={"logit_bias": {"①": 5, "1": 2}})
@example(changes={"logit_bias": {"1" * 5000: 1}})
@example(changes={"user": _deep(1000)})
@example(changes={"prompt": _deep(1000)})
@example(changes={"stop": _deep(900)})
@example(changes={"prompt": [[5] * 3] * 300, "n": 2})
@example(changes={"seed": 2**63})
@example(changes={"max_tokens": 2**63 - 1})
@example(changes={"n": 2, "max_tokens": 2**62})
@example(changes={"prompt": ["\ud800"]})
def test_any_json_body_is_a_job_or_a_400(engine: Engine, changes: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": "test", "prompt": "Hello", "max_tokens": 4, **changes}
    try:
        body = _through_json(body)
    except (orjson.JSONEncodeError, orjson.JSONDecodeError):
        return  # not something a JSONL line can carry (orjson's own depth/size limits)
    req, err = check_completion_body(body)
    if err is not None:
        assert req is None
        assert isinstance(err["message"], str) and len(err["message"]) < 1000, err
        assert err["type"] == "invalid_request_error"
        assert err["param"] is None or isinstance(err["param"], str)
    else:
        # Its enqueued tokens, summed over a batch of the most lines, fit the quota's bigint.
        assert req is not None
        assert COUNTER.line(req) * Settings().max_batch_lines < 2**63, body
    out = preparer(engine)(GenRequest(key=7, body=body))
    if isinstance(out, GenResult):
        assert out.status_code == 400 and out.error is not None, out
        assert out.key == 7
        assert len(out.error["message"]) < 1000
    else:
        assert isinstance(out, EngineRequest)
        assert err is None, "the engine accepted what validation rejected"


def test_unicode_digit_logit_bias_is_a_400_naming_it(engine: Engine) -> None:
    for key in ("²", "¹", "①"):
        body = {"model": "test", "prompt": "Hi", "logit_bias": {key: 1, "3": 1}}
        out = preparer(engine)(GenRequest(key=1, body=body))
        assert isinstance(out, GenResult) and out.status_code == 400, out
        assert out.error is not None and out.error["param"] == "logit_bias", out.error


def test_seed_range_message_says_the_real_maximum() -> None:
    _, err = check_completion_body({"model": "m", "prompt": "x", "seed": 2**63})
    assert err is not None
    assert "9223372036854775807" in err["message"]
    assert "maximum of 9223372036854775808" not in err["message"]


def test_sequences_per_line_are_capped_naming_both_numbers() -> None:
    body = {"model": "m", "prompt": ["p"] * 200, "n": 10}
    _, err = check_completion_body(body, max_sequences=256)
    assert err is not None and err["param"] == "n"
    assert "2000" in err["message"] and "256" in err["message"]
    ok, err = check_completion_body({**body, "n": 1}, max_sequences=256)
    assert err is None and ok is not None and ok.sequences == 200
    _, err = check_completion_body({**body, "n": 1, "best_of": 2}, max_sequences=256)
    assert err is not None and err["param"] == "best_of" and "400" in err["message"]
