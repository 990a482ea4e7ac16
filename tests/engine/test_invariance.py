"""Batch invariance (engine/loading/invariance.py): a line gives the same bits whatever shares its
steps, the guarantee a seeded request and a preempted line rest on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from batchwright.engine.engine import Engine
from batchwright.engine.loading.invariance import rows_multiple
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.serving.lines import serve


def _line(i: int, **kw: Any) -> GenRequest:
    body = {"model": "test", "prompt": f"Line {i}: " + "the river ran " * (i % 5), **kw}
    return GenRequest(i, body)


def _results(engine: Engine, lines: list[GenRequest]) -> dict[Any, GenResult]:
    return {r.key: r for r in serve(engine, lines)}


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_line_has_the_same_bits_whatever_shares_its_steps(
    make_engine: Callable[..., Engine], prefix_cache: bool
) -> None:
    kinds: list[dict[str, Any]] = [
        {"max_tokens": 24, "temperature": 0, "logprobs": 3},
        {"max_tokens": 20, "temperature": 1.0, "seed": 7, "logprobs": 2, "n": 2},
        {"max_tokens": 22, "temperature": 0.7, "top_p": 0.9, "seed": 3, "echo": True},
    ]
    probes = [_line(100 + i, **kind) for i, kind in enumerate(kinds)]
    engine = make_engine(max_rows=8, prefix_cache=prefix_cache)
    if engine.lm.invariant_rows is None:
        pytest.skip("no batch-invariant row count on this CPU (logged at load)")
    alone = {p.key: _results(engine, [p])[p.key] for p in probes}
    # Beside lines of other lengths and parameters, admitted in other steps and rows.
    others = [_line(i, max_tokens=5 + 3 * i, temperature=0.5, seed=i) for i in range(11)]
    mixed = _results(engine, [*others[:5], probes[0], *others[5:], *probes[1:]])
    for key, result in alone.items():
        assert result.completion is not None and mixed[key].completion is not None
        assert mixed[key].completion["choices"] == result.completion["choices"], key


def test_the_check_finds_no_multiple_where_rows_depend_on_their_neighbours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer whose row results depend on the row count is reported as such: the engine
    then makes no bit-for-bit promise instead of a false one."""

    class Leaky(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Leaky(8, 8))
    honest = rows_multiple(model)
    assert honest is not None  # torch's own GEMM on a tiny layer tiles by some multiple

    def dependent(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        # Each row gets a rounding error that depends on how many rows came with it.
        return x @ w.T + x.shape[0] * 1e-7

    monkeypatch.setattr(torch.nn.functional, "linear", dependent)
    assert rows_multiple(model) is None
