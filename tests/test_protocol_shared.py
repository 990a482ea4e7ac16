"""Completion and chat bodies share one base of parameters and checks
(protocol/sampling.py); each endpoint keeps its own wire order and messages."""

from __future__ import annotations

from typing import Any

import pytest

from batchwright.protocol.chat import ChatCompletionRequest, check_chat_body
from batchwright.protocol.completions import CompletionRequest, check_completion_body

PROMPT = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_wire_order_names_every_parameter_once(model: Any) -> None:
    assert len(set(model.PARAMS)) == len(model.PARAMS)
    assert set(model.PARAMS) == set(model.model_fields)


C, H = check_completion_body, check_chat_body


@pytest.mark.parametrize(
    "check, body, param",
    [
        # The endpoint's own parameter before the shared ones, as it stands in the body.
        (C, {"model": "m", "prompt": 5, "temperature": 9}, "prompt"),
        (C, {**PROMPT, "max_tokens": -1, "temperature": 9}, "max_tokens"),
        (C, {**PROMPT, "top_p": 5, "n": 0}, "top_p"),
        (C, {**PROMPT, "seed": "s", "logprobs": 9}, "logprobs"),
        (C, {**PROMPT, "suffix": "s", "stream_options": {}}, "suffix"),
        (H, {"model": "m", "messages": [], "temperature": 9}, "messages"),
        (H, {**CHAT, "top_p": 5, "n": 0}, "n"),
        (H, {**CHAT, "seed": "s", "logprobs": 9}, "seed"),
        (H, {**CHAT, "user": 1, "response_format": 1}, "response_format"),
        (H, {**CHAT, "stream": 1, "metadata": 1}, "metadata"),
    ],
)
def test_the_first_wrong_parameter_in_the_endpoints_order_is_reported(
    check: Any, body: dict[str, Any], param: str
) -> None:
    req, err = check(body, 64)
    assert req is None and err is not None and err["param"] == param, err


@pytest.mark.parametrize(
    "check, body, param, message",
    [
        (
            C,
            {**PROMPT, "n": 3, "best_of": 2},
            "best_of",
            "Invalid 'best_of': best_of must be greater than or equal to n (got best_of=2, n=3).",
        ),
        (
            C,
            {**PROMPT, "n": 1, "best_of": 2, "stream": True},
            "best_of",
            "Invalid 'best_of': best_of > n cannot be streamed (got best_of=2, n=1): the "
            "candidates are ranked once all of them are done.",
        ),
        (
            H,
            {**CHAT, "top_logprobs": 2},
            "top_logprobs",
            "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
        ),
        *[
            (
                check,
                {**body, "stream_options": {"include_usage": True}},
                "stream_options",
                "Invalid 'stream_options': stream_options is only allowed when stream is true.",
            )
            for check, body in ((C, PROMPT), (H, CHAT))
        ],
    ],
)
def test_a_check_across_parameters_names_one(
    check: Any, body: dict[str, Any], param: str, message: str
) -> None:
    req, err = check(body, 64, online=True)
    assert req is None and err == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


@pytest.mark.parametrize(
    "check, body, lines",
    [
        (C, PROMPT, "/v1/completions lines"),
        (H, CHAT, "chat lines"),
    ],
)
def test_a_batch_line_cannot_stream(check: Any, body: dict[str, Any], lines: str) -> None:
    _, err = check({**body, "stream": True}, 64)
    assert err is not None and err["param"] == "stream"
    assert err["message"] == (
        f"Invalid 'stream': stream=true is not supported in a batch: {lines} run to "
        "completion server-side."
    )
