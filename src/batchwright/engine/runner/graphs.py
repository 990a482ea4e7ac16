"""Captured decode steps: on CUDA a steady decode step (no prompt admitted) is one graph
replay instead of a thousand kernel launches from Python.

A step's device work reads only tensors that live as long as the model runner (slot
state, block table, KV pools, sampler state), so it can be recorded once and replayed: the
decode forward (one variable-length attention call per layer), the sampler's fixed
graph and the in-place advance of tokens and lengths. Graphs are keyed by the step's
row count (a bucket, slots.py) and a KV-length bucket: `varlen_attn` takes the longest
key length as a host integer, and a captured call keeps the one it was recorded with,
so graphs are recorded for powers of two, which bound the rows' real lengths (each row
reads exactly its own, through `seqused`). The first step of a key runs eagerly, which
is also the warm-up a capture needs, and records the graph; later ones replay it.
Admission steps (prompts in the forward) always run eagerly.

What stays on the host around a replay is the sampler's uniform top-up (an in-place
copy into its ring, before) and its cursor bookkeeping (after).

`Capture` is how a step is recorded: `CudaCapture` with `torch.cuda.CUDAGraph` on one
memory pool for every graph (only one runs at a time, and each step's packed output is
copied out, stream-ordered, before the next replay), on the model's device, without a
device synchronize or an allocator flush; `EagerCapture` elsewhere (replay runs the step
again: how the runner's graph path runs, and is checked, on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from batchwright.engine.platform.device import on, stream
from batchwright.engine.sampling.sampler import Sampler
from batchwright.registry import ModelSpec

log = logging.getLogger(__name__)

Body = Callable[[], torch.Tensor]
# The smallest KV-length bucket (one CUDA block).
KV_BUCKET_MIN = 256


def kv_bucket(max_k: int, cap: int) -> int:
    """The key length a graph is recorded with: the next power of two, at least
    KV_BUCKET_MIN, at most `cap` (the context length)."""
    k = KV_BUCKET_MIN
    while k < max_k:
        k *= 2
    return max(max_k, min(k, cap))


class Replay(Protocol):
    def __call__(self) -> torch.Tensor: ...


class Capture(Protocol):
    def first(self, body: Body) -> tuple[torch.Tensor, Replay]:
        """Run `body` once for real (this step's outputs) and record it for replays."""
        ...


class EagerCapture:
    """Replays run the body again (CPU, tests)."""

    def first(self, body: Body) -> tuple[torch.Tensor, Replay]:
        return body(), body


class CudaCapture:
    """Records on a side stream of the model's device. Not `torch.cuda.graph`: on entry
    it synchronizes the device and empties the allocator's cache, and a graph is recorded
    in the middle of a run (the first step of each key), where both would stall the
    pipeline and hand memory back only to take it again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.failed = False
        with on(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def first(self, body: Body) -> tuple[torch.Tensor, Replay]:
        out = body()  # the real step, and the warm-up capture wants (lazy library init)
        if self.failed:
            return out, body
        graph = torch.cuda.CUDAGraph()
        main = stream(self.device)
        # Recording launches nothing: the state the body updates in place is untouched.
        # `thread_local`: other threads' CUDA calls (a metrics read) do not void it.
        try:
            with on(self.device):
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    graph.capture_begin(self.pool, capture_error_mode="thread_local")
                    try:
                        static = body()
                    finally:
                        graph.capture_end()
                main.wait_stream(self.side)
        except RuntimeError as e:
            # The step itself ran (`out`); steps go on eagerly, with the same results.
            self.failed = True
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
            return out, body

        def replay() -> torch.Tensor:
            with on(self.device):
                graph.replay()
            return static

        return out, replay


def graphs_on(spec: ModelSpec, device: torch.device, backend: str) -> bool:
    """Whether steady decode steps replay graphs (registry `cuda_graphs`; default: on
    CUDA). Only the varlen attention's step is fixed enough to record."""
    on = spec.cuda_graphs if spec.cuda_graphs is not None else device.type == "cuda"
    return on and backend == "varlen"


def capture_for(device: torch.device) -> Capture:
    return CudaCapture(device) if device.type == "cuda" else EagerCapture()


class Decoder(Protocol):
    """What a captured step runs (the model runner is one)."""

    sampler: Sampler
    context_length: int
    adapters_on: bool  # the step adds LoRA deltas (engine/lora/): another graph

    def decode_body(self, n: int, max_k: int) -> torch.Tensor:
        """The device work of a decode step over slots [0, n) reading at most `max_k`
        keys, from long-lived tensors only: the packed sampler output."""
        ...


class DecodeGraphs:
    """Decode steps of a model runner by graph, one per (rows, KV-length bucket)."""

    def __init__(self, runner: Decoder, capture: Capture) -> None:
        if runner.sampler.shortcut:
            raise ValueError("a captured step needs the sampler's one fixed graph")
        self.runner = runner
        self.capture = capture
        self.cap = runner.context_length
        self.graphs: dict[tuple[int, int, bool, int, bool], Replay] = {}
        self.replays = 0

    def step(self, n: int, max_k: int) -> torch.Tensor:
        """One decode step over slots [0, n) whose rows read at most `max_k` keys; the
        packed sampler output (on the device; valid until the next step)."""
        sampler = self.runner.sampler
        sampler.prepare(n)
        bucket = kv_bucket(max_k, self.cap)
        # A step with a grammar-constrained row, or one packing more top logprobs, runs
        # another variant of the sampler's graph (sampler.core).
        key = (n, bucket, sampler.masked(n), sampler.width(n), self.runner.adapters_on)
        replay = self.graphs.get(key)
        if replay is None:
            packed, self.graphs[key] = self.capture.first(
                lambda: self.runner.decode_body(n, bucket)
            )
        else:
            packed = replay()
            self.replays += 1
        sampler.commit(n)
        return packed
