"""Attention over packed inputs with no KV cache: each input attends to its own tokens
only, causally for a decoder and both ways for an encoder.

The model runs with `attn_implementation="batchwright_embed"` on one packed row (batch 1,
every input back to back, no padding anywhere). Before a forward the engine sets a `Packed`
plan (packing.py):

- CUDA: one `varlen_attn` call per layer over the whole row (cu_seqlens).
- CPU, float32: one call of the engine's native kernel per layer over every input
  (platform/csrc/packed_attention.h): SDPA's flash kernel runs its products as GEMM calls
  too thin at head dims of 32-64 to reach a linear layer's speed (1.1-1.9x on the
  embedding bench's shapes, docs/embeddings.md).
- elsewhere (other dtypes or head dims, no compiler): one SDPA call per run of inputs of
  equal length, as a batch of them with no mask (the packer puts equal lengths side by
  side), so no token attends to padding and none is computed for it.

Nothing is written anywhere: the keys and values of a forward are gone after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchwright.engine.attention import registration
from batchwright.engine.platform import native

NAME = "batchwright_embed"
# Per-layer variants this attention lacks: such a model runs padded (model.py).
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


@dataclass(eq=False)
class Packed:
    """One forward's inputs: `runs` of (first token, inputs, length) of equal-length inputs,
    back to back and covering the row; `cu` and `max_len` for the varlen kernel."""

    runs: list[tuple[int, int, int]]
    cu: torch.Tensor | None  # [inputs + 1] int32 on the device (CUDA only)
    max_len: int
    varlen: bool
    # [inputs] first token and length of each input, on the host (the native kernel's)
    starts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


_PLAN: ContextVar[Packed | None] = ContextVar("batchwright_embed_plan", default=None)


@contextmanager
def packed(plan: Packed) -> Iterator[None]:
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plan = _PLAN.get()
    if plan is None:
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if unsupported:
        raise NotImplementedError(f"packed embedding attention does not support {unsupported}")
    causal = bool(getattr(module, "is_causal", False))
    gqa = query.shape[1] != key.shape[1]
    # [1, heads, tokens, dim] -> [tokens, heads, dim] (a view: the projections made them so)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if plan.varlen:
        from torch.nn.attention.varlen import varlen_attn

        assert plan.cu is not None
        row = varlen_attn(
            q,
            k,
            v,
            plan.cu,
            plan.cu,
            plan.max_len,
            plan.max_len,
            scale=scaling,
            window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=gqa,
        )
        assert isinstance(row, torch.Tensor)
        return row[None], None
    kernel = _native(q, k, v, plan)
    if kernel is not None:
        assert plan.starts is not None and plan.lengths is not None
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        return kernel(q, k, v, plan.starts, plan.lengths, scale, causal)[None], None
    result = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    for start, n, length in plan.runs:
        end = start + n * length
        # [n * length, heads, dim] -> [n, heads, length, dim]
        qs, ks, vs = (t[start:end].view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal and length > 1, scale=scaling, enable_gqa=gqa
        )
        result[start:end] = attended.transpose(1, 2).flatten(0, 1)
    return result[None], None


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Packed) -> Any:
    """The native kernel where it takes this forward (float32 on CPU, a head dim it
    takes, rows of unit stride, the inputs' offsets at hand), else None."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or plan.starts is None:
        return None
    if any(t.stride(-1) != 1 for t in (q, k, v)) or v.shape[-1] != q.shape[-1]:
        return None
    module = native.module()
    if module is None or q.shape[-1] % module.packed_attention_dims():
        return None
    return module.packed_attention


def register() -> None:
    registration.register(NAME, attention, _PLAN)
