"""torch.compile on the CUDA path: the model's forward under a varlen plan, and the
sampler's fixed graph.

Eager, a decode step of a Qwen2-shaped model launches about forty kernels a layer: an
RMSNorm is eight elementwise kernels in bfloat16 (casts, pow, mean, rsqrt, two muls),
rotary ten, SiLU-and-mul two, each residual add one. Compiled whole, the forward keeps
its matmuls and the attention (torch's `varlen_attn`, a custom op inductor leaves
opaque) and fuses what lies between them: a layer's norm with the residual add before
it, rotary with the paged-cache writes, SiLU with the multiply (bench/step_profile.py
--cuda-launches counts them). The sampler's step is compiled the same way (its
elementwise work fused, four passes over [B, vocab] instead of about thirty).

Shapes are dynamic from the start: one graph for decode steps (one query a row) and one
for steps that admit prompts, whatever their rows, tokens and key lengths (and one more
where a size is 1, which torch always specialises). On by default on CUDA (registry
`torch_compile`); off on CPU, where the first run must start fast and the native kernel
already does the attention (the forward's elementwise work is a small share there). A
compile that fails logs one line and the engine runs that part eagerly from then on:
compile errors surface before anything runs, so nothing is half done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from batchwright.registry import ModelSpec

log = logging.getLogger(__name__)


def compile_on(spec: ModelSpec, device: torch.device, backend: str) -> bool:
    """Whether the engine compiles its forward and sampler (registry `torch_compile`;
    default: on CUDA with the varlen attention)."""
    if spec.torch_compile is not None:
        return spec.torch_compile
    return device.type == "cuda" and backend == "varlen"


class Compiled:
    """`fn` compiled, or `fn` itself once compiling it failed."""

    def __init__(self, fn: Callable[..., Any], what: str, **options: Any) -> None:
        self.fn = fn
        self.what = what
        self.compiled: Callable[..., Any] = torch.compile(fn, **options)
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.failed = True
                log.warning("torch.compile of the %s failed, running it eagerly: %s", self.what, e)
        return self.fn(*args, **kwargs)
