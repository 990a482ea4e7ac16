"""How attention reads the cache in one step: the plan of each backend (attention/).

Decode rows come first (one query each, a dead row reading its one scratch token), then
the prompts being prefilled, back to back, each from its first token not cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchwright.engine.attention.backends import VarlenArgs
from batchwright.engine.attention.interface import Step, decode_runs, fixed_runs
from batchwright.engine.attention.prefix_attention import CachedPrompts
from batchwright.engine.attention.prefix_attention import plan as plan_cached
from batchwright.engine.kv.manager import Placement
from batchwright.engine.kv.paged import PagedCache
from batchwright.engine.runner.slots import Slots

# Reference attention: on CPU, runs minimise tokens gathered plus this many per call
# (about one SDPA call's cost); elsewhere runs of fixed size (each call is a launch).
_CALL_COST = 120
_MAX_RUN = 16
_GPU_RUN = 64


def plan_attention(
    plan: Step, slots: Slots, n: int, placed: Sequence[Placement], max_k: int
) -> None:
    """The backend's part of `plan` for decode rows [0, n) and the `placed` prompts."""
    s = slots
    if plan.backend == "native":
        plan.lens = torch.where(s.alive[:n], s.lens[:n] + 1, 0)
    elif plan.backend == "reference":
        lengths = [
            x + 1 if q is not None else 1 for x, q in zip(s.hlen[:n], s.seqs[:n], strict=True)
        ]
        live = [q is not None for q in s.seqs[:n]]
        if s.device.type == "cpu":
            plan.runs = decode_runs(lengths, live, _CALL_COST, _MAX_RUN)
        else:
            plan.runs = fixed_runs(lengths, _GPU_RUN) if n else []
        plan.run_lens = lengths
    else:
        plan.varlen = varlen_args(s, n, placed, max_k)


def varlen_args(slots: Slots, n: int, placed: Sequence[Placement], max_k: int) -> VarlenArgs:
    """Decode rows (one query, dead rows read one scratch token) then prompts."""
    s = slots
    cache = s.cache
    # A dead row (length 0) reads its one scratch token.
    seqused = (s.lens[:n] + 1).int()
    table = cache.table[:n]
    cu_q = s.arange_int[: n + 1]
    max_q = 1
    if placed:
        lengths = [p.length for p in placed]
        new = [p.length - p.cached for p in placed]  # queries after a cached prefix
        seqused = torch.cat([seqused, s.host_int(lengths)])
        table = torch.cat([table, cache.host_rows([p.slot for p in placed])])
        starts = [n]
        for x in new:
            starts.append(starts[-1] + x)
        cu_q = torch.cat([cu_q[:n], s.host_int(starts)])
        max_q, max_k = max(max_q, *new), max(max_k, *lengths)
    cu_k = torch.nn.functional.pad(seqused.cumsum(0, dtype=torch.int32), (1, 0))
    return VarlenArgs(cu_q, cu_k, seqused, table, max_q, max_k)


def cached_prompts(
    cache: PagedCache,
    rows: int,
    placed: Sequence[Placement],
    bounds: Sequence[tuple[int, int]],
    backend: str,
    every: bool = False,
) -> CachedPrompts | None:
    """The attention plan of the placed prompts with a cached prefix, or of all of them
    with `every` (`bounds`: their new tokens in the packed row, counted after the `rows`
    decode rows)."""
    spans = [
        (rows + s, rows + e, p.cached)
        for (s, e), p in zip(bounds, placed, strict=True)
        if p.cached or every
    ]
    if not spans:
        return None
    table = cache.host_rows([p.slot for p in placed if p.cached or every])
    return plan_cached(spans, table, native=backend == "native")
