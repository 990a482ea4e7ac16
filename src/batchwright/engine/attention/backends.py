"""The three ways attention reads the paged cache (see attention.py for when each runs).

Pools are `[blocks, block_size, kv_heads, dim]`; the block table maps a row's i-th block
of tokens to a pool block.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.attention.variants import PLAIN, Variant, attend, with_sinks


@dataclass(eq=False)
class VarlenArgs:
    """One `varlen_attn` call over decode rows (one query each) and prompts."""

    cu_q: torch.Tensor  # [seqs + 1] int32: query offsets in the packed row
    cu_k: torch.Tensor  # [seqs + 1] int32: cumulative key lengths
    seqused: torch.Tensor  # [seqs] int32: tokens each sequence reads from its blocks
    table: torch.Tensor  # [seqs, max_blocks] int32
    max_q: int
    max_k: int


def _varlen_attn(*args: Any, **kwargs: Any) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    out = varlen_attn(*args, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out


# Swappable so bench/step_profile.py can run the CUDA path's bookkeeping on CPU.
VARLEN_IMPL: Callable[..., torch.Tensor] = _varlen_attn

# What `varlen` passes besides the positional arguments: a paged cache needs the last two,
# which torch.nn.attention.varlen has from torch 2.12 (2.10 and 2.11 ship the module
# without them; pyproject's `worker` extra and the Dockerfile's image require 2.12).
VARLEN_KEYWORDS = ("scale", "window_size", "enable_gqa", "seqused_k", "block_table")


def varlen_missing(fn: Callable[..., Any] | None = None) -> list[str]:
    """What the installed torch's `varlen_attn` (or `fn`) lacks of what `varlen` calls it
    with; empty when it has everything."""
    if fn is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return ["torch.nn.attention.varlen"]
        fn = varlen_attn
    params = inspect.signature(fn).parameters
    return [k for k in VARLEN_KEYWORDS if k not in params]


def varlen(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    args: VarlenArgs,
    scale: float,
    gqa: bool,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """[tokens, heads, dim] for every query token of the packed row, in one call. A
    window is FlashAttention's (W - 1 to the left, none to the right); sinks rescale the
    output by its log-sum-exp. Soft-capping is not there: the loader picks the reference
    backend for models that use it."""
    assert variant.softcap is None, "varlen_attn has no soft-capping"
    if variant.window is not None:
        window = (variant.window - 1, 0)
    else:
        # Causal, aligned bottom-right (a decode row sees all its keys). With one query a
        # row, causal is full attention: say so, and FlashAttention packs the query heads
        # that share a key head into one tile (it does only without a window).
        window = (-1, -1) if args.max_q == 1 else (-1, 0)
    extra: dict[str, Any] = {}
    if variant.sinks is not None:
        from torch.nn.attention.varlen import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    out = VARLEN_IMPL(
        q,
        kpool,
        vpool,
        args.cu_q,
        args.cu_k,
        args.max_q,
        args.max_k,
        scale=scale,
        window_size=window,
        enable_gqa=gqa,
        seqused_k=args.seqused,
        block_table=args.table,
        **extra,
    )
    if variant.sinks is None:
        return out
    attended, lse = out
    return with_sinks(attended, lse, variant.sinks)


def native(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    kernel = paged_attention_kernel()
    assert kernel is not None, "the native backend needs the compiled kernel"
    if variant is PLAIN:
        return kernel(q, kpool, vpool, table, lens, scale)
    return kernel(
        q,
        kpool,
        vpool,
        table,
        lens,
        scale,
        window=variant.window or 0,
        softcap=variant.softcap or 0.0,
        sinks=variant.sinks,
    )


def gather(
    pool: torch.Tensor, table: torch.Tensor, width: int, lens: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows' first `width` tokens, gathered from their blocks: [rows, kv_heads, width, dim].

    With `lens`, columns at or past each row's length are zeroed: they lie in blocks never
    written (the pool is uninitialised memory, possibly NaN), and a masked NaN still poisons
    SDPA (0 x NaN in the weighted sum)."""
    blocks = -(-width // pool.shape[1])
    pages = pool[table[:, :blocks].long()]  # [rows, blocks, block_size, heads, dim]
    out = pages.flatten(1, 2)[:, :width]
    if lens is not None:
        past = torch.arange(width, device=out.device)[None, :] >= lens.to(out.device)[:, None]
        out = out.masked_fill(past[:, :, None, None], 0.0)
    return out.transpose(1, 2)


def reference(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    table: torch.Tensor,
    runs: list[tuple[int, int, int]],
    lens: list[int],
    scale: float,
    gqa: bool,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """Decode attention by page gather and SDPA, one call per run of rows; rows in no run
    (dead slots) get zeros. [rows, heads, dim]."""
    out = q.new_zeros((q.shape[0], q.shape[1], vpool.shape[-1]))
    window = variant.window
    for a, b, w in runs:
        run_lens = torch.as_tensor(lens[a:b])
        keys = gather(kpool, table[a:b], w, run_lens)
        values = gather(vpool, table[a:b], w, run_lens)
        cols = torch.arange(w)[None, :]
        hidden = cols >= run_lens[:, None]
        if window is not None:
            hidden |= cols < run_lens[:, None] - window
        if not variant.plain or bool(hidden.any()):
            allowed = (~hidden).to(q.device)[:, None, None, :]
            out[a:b] = attend(q[a:b, :, None], keys, values, allowed, scale, variant, gqa)[:, :, 0]
            continue
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b, :, None], keys, values, scale=scale, enable_gqa=gqa
        )[:, :, 0]
    return out


def varlen_reference(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    return_aux: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attn` with a block table, one SDPA call per sequence: what the CUDA backend
    computes, runnable anywhere (tests, and bench/step_profile.py on CPU). A window
    (left, 0) is FlashAttention's: `left` keys before the query's own; with `return_aux`
    the log-sum-exp [heads, tokens] comes too."""
    assert seqused_k is not None and block_table is not None
    left, right = window_size
    causal = right == 0
    lse_out = q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
    out = q.new_empty((*q.shape[:2], vpool.shape[-1]))
    starts, used = cu_q.tolist(), seqused_k.tolist()
    for i, n in enumerate(used):
        a, b = starts[i], starts[i + 1]
        keys = gather(kpool, block_table[i : i + 1], n)
        values = gather(vpool, block_table[i : i + 1], n)
        mask = None
        if causal:  # bottom-right aligned: query j sees keys up to n - (b - a) + j
            last = torch.arange(b - a, device=q.device)[:, None] + n - (b - a)
            cols = torch.arange(n, device=q.device)[None, :]
            mask = cols <= last
            if left >= 0:
                mask &= cols >= last - left
        qs = q[a:b].transpose(0, 1)[None]
        att = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        out[a:b] = att[0].transpose(0, 1)
        if return_aux is not None:
            ks = keys.repeat_interleave(qs.shape[1] // keys.shape[1], 1) if enable_gqa else keys
            s = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * (
                scale if scale is not None else qs.shape[-1] ** -0.5
            )
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            lse_out[:, a:b] = torch.logsumexp(s, dim=-1)[0]
    if return_aux is not None and return_aux.lse:
        return out, lse_out
    return out


@torch.library.custom_op("batchwright::varlen_reference", mutates_args=())
def _varlen_reference_op(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    window: list[int],
    gqa: bool,
    seqused: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    out = varlen_reference(
        q,
        kpool,
        vpool,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(window[0], window[1]),
        enable_gqa=gqa,
        seqused_k=seqused,
        block_table=table,
    )
    assert isinstance(out, torch.Tensor)
    return out


@_varlen_reference_op.register_fake
def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(q)


def varlen_reference_op(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """`varlen_reference` as an opaque op, as torch's `varlen_attn` is one: a compiled
    forward on CPU keeps it whole (tests, bench/step_profile.py --cuda-launches)."""
    out: torch.Tensor = _varlen_reference_op(
        q,
        kpool,
        vpool,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale,
        list(window_size),
        enable_gqa,
        seqused_k,
        block_table,
    )
    return out
