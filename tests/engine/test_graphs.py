"""Captured decode steps (engine/graphs.py), checked on CPU.

A CUDA graph replays the kernels its step launched when recorded, with the same
arguments: the same tensors (addresses), shapes and host values. So a step is safe to
capture when running it again issues exactly the same calls on the same long-lived
tensors, reads nothing back and copies nothing from the host. Here every "replay" runs
the step again under a recorder and compares its calls with the recorded ones, and the
engine's results with graphs must equal those without.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchwright.engine.attention import backends
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.requests.types import GenRequest
from batchwright.engine.runner.graphs import KV_BUCKET_MIN, Body, DecodeGraphs, Replay, kv_bucket
from batchwright.engine.runner.model_runner import ModelRunner
from batchwright.serving.lines import serve

# Ops that read a device value back, or whose output shape depends on data: a capture
# fails on them (and any host-built tensor is a copy baked in at record time).
_FORBIDDEN = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::masked_select",
    "aten::lift_fresh",
    "aten::repeat_interleave",
}


class _Recorder(TorchDispatchMode):
    """Every non-view call of a step: op, and each argument as what a replay would see
    (long-lived tensors by address; the step's own temporaries by layout only)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.mine: set[int] = set()  # storages the step allocated
        self.keep: list[torch.Tensor] = []  # so their addresses are not reused meanwhile
        self.paused = False

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            ptr = _ptr(a)
            layout = (tuple(a.shape), a.stride(), a.dtype, a.storage_offset())
            return ("tmp", *layout) if ptr in self.mine else ("long-lived", ptr, *layout)
        if isinstance(a, list | tuple):
            return tuple(self.arg(x) for x in a)
        if isinstance(a, torch.dtype | torch.device | torch.memory_format | torch.layout):
            return repr(a)
        return a

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func._schema.name
        assert name not in _FORBIDDEN, f"{name} in a captured step"
        sig = tuple(self.arg(a) for a in args)
        # Storages new in the outputs are the step's own (views, and `to` returning its
        # input under inference mode, are not; a `to` that copies is a kernel).
        seen = {_ptr(t) for t in _tensors(args)}
        new = [t for t in _tensors(out) if _ptr(t) not in seen]
        if func.is_view and not new:
            return out
        self.calls.append((name, sig, tuple(sorted((k, self.arg(v)) for k, v in kwargs.items()))))
        self.mine.update(_ptr(t) for t in new)
        self.keep.extend(new)
        return out


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for a in x for t in _tensors(a)]
    return []


_RECORDING: list[_Recorder] = []


def _varlen_stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
    """varlen_attn's semantics on CPU, recorded as the one call it is on CUDA."""
    rec = _RECORDING[-1] if _RECORDING else None
    if rec is not None:
        rec.calls.append(
            (
                "varlen_attn",
                tuple(rec.arg(a) for a in args),
                tuple(sorted((k, rec.arg(v)) for k, v in kwargs.items())),
            )
        )
        rec.paused = True
    try:
        out = backends.varlen_reference(*args, **kwargs)
    finally:
        if rec is not None:
            rec.paused = False
    if rec is not None:
        rec.mine.add(_ptr(out))
        rec.keep.append(out)
    return out


class VerifyingCapture:
    """Replays run the step again and assert it made the recorded calls."""

    def __init__(self) -> None:
        self.recorded = 0
        self.checked = 0

    @staticmethod
    def _run(body: Body) -> tuple[torch.Tensor, _Recorder]:
        rec = _Recorder()
        tolist = torch.Tensor.tolist

        def no_tolist(t: torch.Tensor) -> Any:
            assert rec.paused, "tolist() in a captured step"
            return tolist(t)

        _RECORDING.append(rec)
        torch.Tensor.tolist = no_tolist  # type: ignore[method-assign,assignment]
        try:
            with rec:
                out = body()
        finally:
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]
            _RECORDING.pop()
        return out, rec

    def first(self, body: Body) -> tuple[torch.Tensor, Replay]:
        out, rec = self._run(body)
        self.recorded += 1
        want = rec.calls
        assert any(c[0] == "varlen_attn" for c in want)

        def replay() -> torch.Tensor:
            again, got = self._run(body)
            assert got.calls == want, "a replay would not do what this step does"
            self.checked += 1
            return again

        return out, replay


def test_kv_buckets() -> None:
    assert [kv_bucket(k, 4096) for k in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert kv_bucket(2100, 2048 + 512) == 2560  # capped at the context length
    assert KV_BUCKET_MIN == 256


def _bodies(vocab: int, eos: set[int]) -> list[dict[str, Any]]:
    rng = random.Random(4)
    out = []
    for i in range(26):
        prompt = [t for t in (rng.randrange(3, vocab) for _ in range(rng.choice([3, 20, 70])))]
        body: dict[str, Any] = {
            "prompt": [t for t in prompt if t not in eos] or [3],
            "max_tokens": 4 + (i * 7) % 40,
            "temperature": rng.choice([0, 0.8]),
            "seed": i,
        }
        if i % 3 == 0:
            body.update(stop=["e", "th"], logprobs=2, n=2, best_of=3, frequency_penalty=0.5)
        if i % 4 == 1:
            body.update(top_p=0.9, presence_penalty=0.4, logit_bias={"5": 3.0})
        out.append(body)
    return out


@pytest.mark.parametrize("lag", [False, True])
def test_captured_steps_replay_what_eager_steps_do(
    make_engine: Any, direct: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag: bool
) -> None:
    # The CUDA path forced on CPU (varlen backend, bucketed rows, the fixed sampling
    # graph) with graphs on: rows join, finish and are compacted while steps replay, and
    # every completion equals the same scheduler's without graphs.
    monkeypatch.setattr(backends, "VARLEN_IMPL", _varlen_stand_in)
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    eng = make_engine(path=path, max_rows=12, max_batch_tokens=160, native_attention=False)
    eng.attention_backend = "varlen"
    reqs = [
        GenRequest(i, {"model": "t", **b}) for i, b in enumerate(_bodies(eng.lm.vocab_size, {2}))
    ]

    def results(graphs: bool) -> tuple[dict[int, Any], VerifyingCapture, ModelRunner]:
        eng.spec.cuda_graphs = graphs
        try:
            sched = eng.new_runner()
        finally:
            eng.spec.cuda_graphs = False
        sched.lag = lag
        cap = VerifyingCapture()
        if graphs:
            assert sched.graphs is not None and sched.slots.fixed
            sched.graphs = DecodeGraphs(sched, cap)
        else:
            assert sched.graphs is None
            sched.slots.fixed, sched.sampler.shortcut = True, False
        out = {}
        for r in serve(eng, reqs, lambda: {7}):
            assert r.completion is not None, r.error
            out[r.key] = (r.completion["choices"], r.completion["usage"])
        assert sched.cache.alloc.used == 0
        return out, cap, sched

    eager, _, _ = results(False)
    captured, cap, sched = results(True)
    assert sched.graphs is not None
    assert cap.recorded == len(sched.graphs.graphs) >= 2  # several row buckets
    assert cap.checked == sched.graphs.replays > 3 * cap.recorded
    assert 7 not in eager and captured == eager
