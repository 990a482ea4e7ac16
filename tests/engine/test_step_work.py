"""What a steady decode step costs the host, checked on CPU with the CUDA path forced:
no value read back inside the forward, the host one step behind without waiting, and
the compiled forward (on by default on CUDA) giving the eager text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchwright.engine.attention import backends
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.requests.types import GenRequest
from batchwright.engine.runner import model_runner
from batchwright.serving.lines import serve

# Ops that read device data on the host: each is a sync on CUDA.
_READS = {"aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::nonzero"}


def _requests(n: int, spread: int = 4) -> list[GenRequest]:
    return [
        GenRequest(i, {"model": "t", "prompt": "the quick brown fox " * (1 + i % 3),
                       "max_tokens": 3 + (i * 7) % spread, "temperature": 0})
        for i in range(n)
    ]  # fmt: skip


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in _READS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_a_decode_forward_reads_nothing_back(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers builds no mask (it would check the position ids for packed sequences
    # and read a boolean back every forward): the step's one sync is its read-back.
    monkeypatch.setattr(backends, "VARLEN_IMPL", backends.varlen_reference_op)
    eng = make_engine(max_rows=4, native_attention=False)
    eng.attention_backend = "varlen"
    forward = eng.forward.step
    modes: list[_Reads] = []

    def decode_forward(ids: Any, positions: Any, keep: Any, plan: Any) -> torch.Tensor:
        if keep is not None:  # a step admitting prompts
            return forward(ids, positions, keep, plan)
        modes.append(_Reads())
        with modes[-1]:
            return forward(ids, positions, keep, plan)

    monkeypatch.setattr(eng.forward, "step", decode_forward)
    assert all(r.status_code == 200 for r in serve(eng, _requests(6)))
    assert len(modes) > 3
    assert [m.seen for m in modes if m.seen] == []


def test_the_host_waits_for_a_step_only_to_move_rows(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One step behind (CUDA), the host records step t while step t + 1 runs. It waits for
    # the step in flight only before moving rows into holes (compaction) and at the end,
    # not whenever nothing waits to be admitted.
    eng = make_engine(max_rows=6)
    reads: list[tuple[int, int]] = []  # (step read, steps launched by then)
    launched, moves = [0], [0]
    orig_step, orig_host = model_runner.ModelRunner._step, model_runner.Outputs.host
    orig_compact = model_runner.ModelRunner.compact

    def step(self: Any, units: Any) -> Any:
        launched[0] += 1
        out = orig_step(self, units)
        if self._pending is not None:
            self._pending.number = launched[0]
        return out

    def host(self: Any) -> torch.Tensor:
        reads.append((getattr(self, "number", 0), launched[0]))
        return orig_host(self)

    def compact(self: Any) -> None:
        before = self.slots.top
        orig_compact(self)
        moves[0] += self.slots.top < before

    monkeypatch.setattr(model_runner.ModelRunner, "_step", step)
    monkeypatch.setattr(model_runner.Outputs, "host", host)
    monkeypatch.setattr(model_runner.ModelRunner, "compact", compact)
    sched = eng.new_runner()
    sched.lag = True
    assert len(list(serve(eng, _requests(14, spread=23)))) == 14
    # A read of the step launched last (none launched after it yet) is a wait.
    waits = sum(1 for number, by_then in reads if number == by_then)
    assert launched[0] > 10 and moves[0] > 0
    assert waits <= moves[0] + 1, (waits, moves, reads)


def test_compiled_forward_gives_the_eager_text(
    make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CUDA path's torch.compile of the forward and the sampler (compiled.py), forced
    # on CPU: inductor's CPU backend, the attention an opaque op as varlen_attn is.
    monkeypatch.setattr(backends, "VARLEN_IMPL", backends.varlen_reference_op)
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    reqs = _requests(5)
    texts = []
    for compiled in (False, True):
        eng = make_engine(path=path, max_rows=4, native_attention=False, torch_compile=compiled)
        eng.attention_backend = "varlen"
        texts.append({r.key: r.completion["choices"][0]["text"] for r in serve(eng, reqs)})
        if compiled:
            assert eng.forward.compiled is not None and not eng.forward.compiled.failed
    assert texts[0] == texts[1]
