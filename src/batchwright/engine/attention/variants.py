"""What a layer's attention adds to plain softmax attention, read from what transformers
passes the attention interface, and the reference computation of each.

transformers hands every attention call its layer's variant as keyword arguments:
`sliding_window` (the layer attends to its last W tokens, itself included: key j is seen
by query i when i - W < j <= i, masking_utils.sliding_window_overlay), `softcap` (scores
become softcap * tanh(score / softcap), Gemma 2), `s_aux` (one more logit per head in the
softmax's denominator, with no value: gpt-oss's attention sinks) and `scaling`. A layer
without a variant gets None for each, so per-layer differences (Gemma's alternating
layers, Qwen2's `max_window_layers`) arrive as transformers computed them.

The fast backends apply them natively (native kernel: window, softcap and sinks;
`varlen_attn`: window, and sinks from its log-sum-exp); everything else goes through
`attend` here: SDPA with a boolean mask where the layer is plain attention (windows are
a mask), the softmax written out where it soft-caps or has sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# What transformers may pass that changes nothing here (bookkeeping of the forward).
HARMLESS = frozenset(
    {
        "dropout",
        "scaling",
        "position_ids",
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "cache_position",
        "layer_type",
    }
)
# What the variants below take.
HANDLED = frozenset({"sliding_window", "softcap", "s_aux"})


@dataclass(frozen=True, eq=False)
class Variant:
    window: int | None = None  # keys a query sees, its own included; None: all before it
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [q_heads] float32

    @property
    def plain(self) -> bool:
        """Softmax attention as SDPA computes it (a window is only a mask)."""
        return self.softcap is None and self.sinks is None


PLAIN = Variant()


def variant_of(kwargs: dict[str, Any], capacity: int | None = None) -> Variant:
    """The layer's variant from the interface's keyword arguments. A window that covers
    `capacity` tokens (what any row can hold) never binds: full attention."""
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if window is not None and (window <= 0 or (capacity is not None and window >= capacity)):
        window = None
    if window is None and softcap is None and sinks is None:
        return PLAIN
    return Variant(
        window=None if window is None else int(window),
        softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else sinks.detach().float().reshape(-1),
    )


def unknown(kwargs: dict[str, Any]) -> list[str]:
    """Arguments given a value that this implementation would ignore."""
    return sorted(
        k for k, v in kwargs.items() if k not in HARMLESS and k not in HANDLED and v is not None
    )


def band(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[queries, keys] True where query i (the last `queries` of `keys` positions, aligned
    bottom-right) may attend: causal, and within `window` when there is one."""
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    variant: Variant,
    gqa: bool,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of q [B, H, Q, D] over k [B, Hk, K, D] and v [B, Hk, K, Dv] where
    `allowed` (broadcast to [B, H, Q, K]) is True, or causally (bottom-right) with
    `causal`. [B, H, Q, Dv]."""
    if variant.plain:
        if allowed is None and not causal:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        if allowed is None:
            if q.shape[2] == k.shape[2]:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa
                )
            allowed = band(q.shape[2], k.shape[2], None, q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa
        )
    if gqa and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    if allowed is None and causal:
        allowed = band(q.shape[2], k.shape[2], None, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.to(scores.device).view(1, -1, 1, 1)
        sink = sink.expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def own_tokens(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, variant: Variant, gqa: bool
) -> torch.Tensor:
    """A prompt attending to its own tokens (causal, windowed where it binds)."""
    n = q.shape[2]
    if variant.window is None or n <= variant.window:
        return attend(q, k, v, None, scale, variant, gqa, causal=True)
    return attend(q, k, v, band(n, n, variant.window, q.device), scale, variant, gqa)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks [T, H, Dv] and its log-sum-exp [H, T] made attention with
    them: each row's weights shrink by exp(lse) / (exp(lse) + exp(sink))."""
    keep = torch.sigmoid(lse.float() - sinks.to(lse.device).float()[:, None])  # [H, T]
    return out * keep.transpose(0, 1)[:, :, None].to(out.dtype)
