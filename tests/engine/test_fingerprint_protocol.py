"""system_fingerprint identity, demo model determinism, and request validation messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchwright.engine.loading.demo import build_demo_model
from batchwright.protocol.completions import check_completion_body


def test_fingerprint_stable_and_sensitive(make_engine: Any, engine: Any, tmp_path: Path) -> None:
    assert make_engine().system_fingerprint == engine.system_fingerprint
    assert make_engine(max_rows=3).system_fingerprint != engine.system_fingerprint
    assert make_engine(dtype="bfloat16").system_fingerprint != engine.system_fingerprint
    same = build_demo_model(tmp_path / "same", seed=0)
    assert make_engine(path=same).system_fingerprint == engine.system_fingerprint
    other = build_demo_model(tmp_path / "other", seed=1)
    assert make_engine(path=other).system_fingerprint != engine.system_fingerprint


def test_demo_model_built_on_first_load(make_engine: Any, tmp_path: Path) -> None:
    eng = make_engine(name="demo", path=tmp_path / "demo")
    assert (tmp_path / "demo" / "model.safetensors").exists()
    assert eng.model_name == "demo"


BASE = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"suffix": "y"}, "suffix", "not supported in a batch"),
        ({"stream": True}, "stream", "not supported in a batch"),
        ({"temperature": 2.5}, "temperature", "2.5 is greater than the maximum of 2"),
        ({"top_p": -0.1}, "top_p", "-0.1 is less than the minimum of 0"),
        ({"n": 129}, "n", "129"),
        ({"logprobs": 6}, "logprobs", "6 is greater than the maximum of 5"),
        ({"presence_penalty": 3}, "presence_penalty", "3"),
        ({"max_tokens": -1}, "max_tokens", "-1"),
        ({"n": 3, "best_of": 2}, "best_of", "best_of=2, n=3"),
        ({"best_of": 21}, "best_of", "21"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "101"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "'x'"),
        ({"prompt": []}, "prompt", "empty"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ({"max_tokens": "5"}, "max_tokens", "'5'"),
    ],
)
def test_check_completion_body_errors(extra: dict[str, Any], param: str, needle: str) -> None:
    req, err = check_completion_body({**BASE, **extra})
    assert req is None and err is not None
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert needle in err["message"]
    if param != "frobnicate":
        assert param in err["message"]


def test_check_completion_body_defaults_and_nulls() -> None:
    req, err = check_completion_body(
        {
            **BASE,
            "temperature": None,
            "stream": False,
            "n": 2,
            "best_of": 3,
            "user": "u",
            "prompt": [[1, 2], [3]],
            "seed": 5,
            "stop": "\n",
        }
    )
    assert err is None and req is not None
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.candidates) == (
        16,
        1.0,
        1.0,
        2,
        3,
    )
    assert req.stop_list == ["\n"] and req.user == "u"
    missing = check_completion_body({"model": "m"})[1]
    assert missing is not None and missing["param"] == "prompt"
    assert check_completion_body("nope")[1] is not None
