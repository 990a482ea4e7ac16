"""The /v1/embeddings body check (torch-free: the API runs it) and the input queue's order:
online inputs first, batches taking turns, inputs of one forward close in length."""

from __future__ import annotations

from typing import Any

import pytest

from batchwright.config import Settings
from batchwright.engine.embed.packing import Input
from batchwright.engine.embed.queue import InputQueue
from batchwright.protocol.embeddings import MAX_INPUTS, check_embedding_body
from batchwright.protocol.endpoints import EMBEDDINGS, endpoint_of, task_error


def error(body: Any) -> dict[str, Any]:
    req, err = check_embedding_body(body)
    assert req is None and err is not None
    return err


@pytest.mark.parametrize(
    ("input_", "count"),
    [("one", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1], [2, 3]], 2), (["x"] * MAX_INPUTS, 2048)],
)
def test_every_input_form(input_: Any, count: int) -> None:
    req, err = check_embedding_body({"model": "m", "input": input_})
    assert err is None and req is not None
    assert req.input_count == count == len(req.inputs)
    assert req.encoding_format == "float" and req.dimensions is None


def test_refusals_name_the_parameter_and_the_input() -> None:
    assert "2049 inputs" in error({"model": "m", "input": ["x"] * 2049})["message"]
    err = error({"model": "m", "input": ["a", "", "c"]})
    assert err["param"] == "input" and "input[1]" in err["message"]
    assert "empty string" in error({"model": "m", "input": ""})["message"]
    assert "empty array" in error({"model": "m", "input": []})["message"]
    assert "input[1]" in error({"model": "m", "input": [[1], []]})["message"]
    assert "negative" in error({"model": "m", "input": [1, -2]})["message"]
    assert error({"model": "m", "input": [1, "a"]})["param"] == "input"
    err = error({"model": "m", "input": "x", "encoding_format": "int8"})
    assert err["param"] == "encoding_format" and "base64" in err["message"]
    assert error({"model": "m", "input": "x", "dimensions": 0})["param"] == "dimensions"
    assert error({"model": "m", "input": "x", "dimensions": True})["param"] == "dimensions"
    assert error({"model": "m", "input": "x", "prompt": "y"})["param"] == "prompt"
    assert error({"input": "x"})["message"] == "Missing required parameter: 'model'."
    assert error([1])["code"] == "invalid_body"


def test_endpoint_and_task() -> None:
    assert endpoint_of({"model": "m", "input": "x"}) == EMBEDDINGS
    assert task_error(EMBEDDINGS, "m", "embed") is None
    assert "generation model" in str(task_error(EMBEDDINGS, "m", "generate"))
    assert "embedding model" in str(task_error("/v1/completions", "m", "embed"))
    assert Settings().max_batch_embedding_inputs == 50_000


def _inputs(owner: object, lengths: list[int]) -> list[Input]:
    return [Input(owner, i, [1] * n) for i, n in enumerate(lengths)]


class Job:
    def __init__(self, group: str) -> None:
        self.group = group


def test_queue_online_first_then_groups_take_turns() -> None:
    q = InputQueue(max_tokens=100)
    big, small, live = Job("big"), Job("small"), Job("online")
    for x in _inputs(big, [50] * 10):
        q.add(x, online=False)
    for x in _inputs(small, [50, 50]):
        q.add(x, online=False)
    for x in _inputs(live, [10, 20]):
        q.add(x, online=True)

    def group(x: Input) -> str:
        return x.owner.group  # type: ignore[attr-defined,no-any-return]

    first = q.next_pack(group)
    # Online inputs alone, in arrival order: their forward ends as soon as it can.
    assert [x.owner for x in first] == [live, live]
    # Then the batches in turn: the small one's two lines are out within three forwards,
    # not behind all ten of the big one's.
    packs = []
    while q:
        packs.append([x.owner for x in q.next_pack(group)])
    last_small = max(i for i, p in enumerate(packs) if small in p)
    assert last_small <= 2, packs
    assert sum(len(p) for p in packs) == 12


def test_queue_packs_close_lengths_within_the_budget() -> None:
    q = InputQueue(max_tokens=100)
    job = Job("g")
    for x in _inputs(job, [5, 90, 30, 31, 29, 200, 6]):
        q.add(x, online=False)
    packs = []
    while q:
        packs.append(sorted(len(x.ids) for x in q.next_pack(lambda x: "g")))
    # The oldest input anchors each forward, its neighbours in length fill it.
    assert packs[0] == [5, 6, 29, 30]
    assert [200] in packs and sum(map(len, packs)) == 7
    assert all(sum(p) <= 100 for p in packs if len(p) > 1)
