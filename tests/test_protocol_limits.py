"""Line and online bodies that are cheap to send and were dear to check (issue 22, item 7):
a list of a million wrong items is one error, not a million built for every branch of a
union (gigabytes and a minute for a 4 MB prompt), and no token count passes int64."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from batchwright.protocol.chat import ChatCompletionRequest, check_chat_body
from batchwright.protocol.completions import CompletionRequest, check_completion_body

MANY = 200_000
MESSAGE = {"role": "user", "content": "x"}
NOT_NUMBERS = dict.fromkeys(map(str, range(MANY)), "x")


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, {"prompt": [0.5] * MANY}, "prompt"),
        (CompletionRequest, {"prompt": [[1, 0.5]] * MANY}, "prompt"),
        (CompletionRequest, {"prompt": "x", "stop": [0.5] * MANY}, "stop"),
        (CompletionRequest, {"prompt": "x", "logit_bias": NOT_NUMBERS}, "logit_bias"),
        (ChatCompletionRequest, {"messages": [0.5] * MANY}, "messages"),
        (ChatCompletionRequest, {"messages": [{**MESSAGE, "content": [0.5] * MANY}]}, "messages"),
        (ChatCompletionRequest, {"messages": [MESSAGE], "stop": [1] * MANY}, "stop"),
        (ChatCompletionRequest, {"messages": [MESSAGE], "logit_bias": NOT_NUMBERS}, "logit_bias"),
    ],
)
def test_a_million_wrong_items_are_one_error(
    model: type[BaseModel], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "m", **body})
    assert info.value.error_count() <= 4, info.value.error_count()
    check = check_completion_body if model is CompletionRequest else check_chat_body
    req, err = check({"model": "m", **body})
    assert req is None and err is not None and err["param"] == param, err
    assert len(err["message"]) < 400


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": 2**63 - 1},
        {"prompt": "x", "n": 2, "max_tokens": 2**62},
        {"messages": [MESSAGE], "max_tokens": 2**63 - 1},
        {"messages": [MESSAGE], "max_completion_tokens": 2**62, "n": 2},
    ],
)
def test_max_tokens_past_any_context_is_that_lines_400(body: dict[str, Any]) -> None:
    check = check_chat_body if "messages" in body else check_completion_body
    req, err = check({"model": "m", **body})
    assert req is None and err is not None, req
    assert err["param"] in ("max_tokens", "max_completion_tokens"), err
    assert "2147483647" in err["message"]
