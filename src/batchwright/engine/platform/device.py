"""The model's device for everything CUDA would otherwise take from the current device.

`device: cuda:1` puts the weights and every tensor on GPU 1, and kernels follow their
tensors; but an event records on the current device's stream, a graph captures on a
side stream of the current device, and a pinned copy is ordered on the current
stream. With the current device left at 0 the step's read-back event would record on
GPU 0's stream and the host would read tokens before GPU 1 wrote them. So the engine
makes its device current when it loads (`use`), enters it around every step (`on`:
another engine or library may have changed it since), and names it explicitly where
torch takes a stream (`stream`, `ReadBack`, graphs.py). On CPU these are no-ops.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def use(device: torch.device) -> None:
    """Make `device` the process's current CUDA device (at load)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def on(device: torch.device) -> AbstractContextManager[Any]:
    """`device` current for the duration (a step, a capture)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()


def stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the engine's work on `device` is ordered on."""
    return torch.cuda.current_stream(device)


def pinned(like: torch.Tensor) -> torch.Tensor:
    """A page-locked host tensor of `like`'s shape and dtype."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


class ReadBack:
    """A tensor of `device` on its way to the host: on CUDA a pinned copy queued on the
    device's stream and an event after it, waited on only when the host reads."""

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.event: torch.cuda.Event | None = None
        if device.type != "cuda":
            self.host = tensor
            return
        self.host = pinned(tensor)
        with on(device):
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record(stream(device))

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
