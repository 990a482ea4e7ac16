"""The CUDA path's start-up and device choices, checked on CPU as far as CPU allows.

What only a GPU shows (bench/gpu_check.sh): that torch's varlen_attn runs these
arguments, that a graph recorded on GPU N replays there, and that the host never reads
a step's tokens before they land.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from batchwright.engine.attention import backends
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.loading.loader import choose_backend
from batchwright.engine.platform import device
from batchwright.engine.requests.types import GenRequest
from batchwright.engine.runner import graphs
from batchwright.serving.lines import serve

CUDA1 = torch.device("cuda", 1)


def _torch_2_10_varlen_attn(
    query: Any,
    key: Any,
    value: Any,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> Any:
    """The signature torch 2.10's varlen_attn had (no GQA, no paged cache)."""


def test_varlen_signature_check() -> None:
    assert backends.varlen_missing() == []  # this torch (2.13) has what the engine passes
    missing = backends.varlen_missing(_torch_2_10_varlen_attn)
    assert missing == ["enable_gqa", "seqused_k", "block_table"]


def test_a_torch_without_paged_varlen_runs_the_reference_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # On CUDA in bf16 a torch whose varlen_attn lacks the paged arguments gets the
    # reference backend and one line saying why, instead of an error at the first step.
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="batchwright.engine.loading.loader"):
        old = choose_backend(cuda, bf16, False, lambda: ["seqused_k", "block_table"])
    assert old == "reference"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "seqused_k, block_table" in lines[0] and "2.12" in lines[0]
    assert choose_backend(cuda, bf16, False, lambda: []) == "varlen"
    asked: list[bool] = []
    assert choose_backend(torch.device("cpu"), torch.float32, False, lambda: asked) == "reference"
    assert choose_backend(torch.device("cpu"), torch.float32, True) == "native"
    assert not asked


def test_decode_only_steps_pass_no_causal_window(
    make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One query a row: causal is full attention, and FlashAttention packs the query heads
    # of a key head only without a window. Steps with prompts stay causal.
    windows: list[tuple[int, tuple[int, int]]] = []

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        windows.append((args[5], tuple(kwargs["window_size"])))
        return backends.varlen_reference(*args, **kwargs)

    monkeypatch.setattr(backends, "VARLEN_IMPL", record)
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    eng = make_engine(path=path, max_rows=4, native_attention=False)
    eng.attention_backend = "varlen"
    reqs = [
        GenRequest(i, {"model": "t", "prompt": "hello there " * (i + 1), "max_tokens": 5})
        for i in range(6)
    ]
    assert all(r.status_code == 200 for r in serve(eng, reqs))
    decode = {w for q, w in windows if q == 1}
    prefill = {w for q, w in windows if q > 1}
    assert decode == {(-1, -1)} and prefill == {(-1, 0)}


class _Recorder:
    """Stands in for the CUDA runtime calls of device.py and graphs.py: records the
    device each names, and fails on a device-wide synchronize or cache flush."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.devices: list[tuple[str, Any]] = []
        self.current = 0
        rec = self

        class Device:
            def __init__(self, d: Any) -> None:
                self.d = torch.device(d)

            def __enter__(self) -> None:
                rec.devices.append(("device", self.d))
                self.prev, rec.current = rec.current, self.d.index

            def __exit__(self, *exc: object) -> None:
                rec.current = self.prev

        class Stream:
            def __init__(self, d: Any = None) -> None:
                self.d = torch.device(d) if d is not None else torch.device("cuda", rec.current)
                rec.devices.append(("Stream", self.d))

            def wait_stream(self, other: Any) -> None:
                assert other.d == self.d

        class Event:
            def record(self, stream: Any = None) -> None:
                rec.devices.append(("Event.record", stream.d if stream else rec.current))

            def synchronize(self) -> None:
                pass

        class Graph:
            def capture_begin(self, pool: Any = None, capture_error_mode: str = "") -> None:
                rec.devices.append(("capture", torch.device("cuda", rec.current)))
                assert capture_error_mode == "thread_local"

            def capture_end(self) -> None:
                pass

            def replay(self) -> None:
                rec.devices.append(("replay", torch.device("cuda", rec.current)))

        class StreamContext:
            def __init__(self, s: Stream) -> None:
                self.s = s

            def __enter__(self) -> None:
                rec.devices.append(("stream", self.s.d))

            def __exit__(self, *exc: object) -> None:
                pass

        def forbidden(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a device-wide synchronize or cache flush mid-run")

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "set_device", lambda d: rec.devices.append(("set", d)))
        monkeypatch.setattr(cuda, "device", Device)
        monkeypatch.setattr(cuda, "Stream", Stream)
        monkeypatch.setattr(cuda, "current_stream", lambda d=None: Stream(d))
        monkeypatch.setattr(cuda, "stream", StreamContext)
        monkeypatch.setattr(cuda, "Event", Event)
        monkeypatch.setattr(cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(cuda, "synchronize", forbidden)
        monkeypatch.setattr(cuda, "empty_cache", forbidden)
        monkeypatch.setattr(device, "pinned", torch.empty_like)


def test_every_cuda_call_names_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # `device: cuda:1`: the read-back event, the capture's stream and the replay are on
    # GPU 1 while the process's current device is 0 (another engine, a library), and a
    # capture mid-run neither synchronizes the device nor empties the allocator's cache.
    rec = _Recorder(monkeypatch)
    device.use(CUDA1)
    packed = torch.arange(6.0).view(2, 3)
    back = device.ReadBack(packed, CUDA1)
    assert torch.equal(back.wait(), packed)
    capture = graphs.CudaCapture(CUDA1)
    out, replay = capture.first(lambda: packed)
    assert out is packed and replay() is packed
    assert rec.devices[0] == ("set", CUDA1)
    named = {kind for kind, _ in rec.devices}
    assert {"Event.record", "capture", "replay", "stream", "Stream"} <= named
    assert all(torch.device(d) == CUDA1 for _, d in rec.devices), rec.devices
