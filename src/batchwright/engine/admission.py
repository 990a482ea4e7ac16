"""Placing admitted prompts: slots for their candidates and blocks for the prefill."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchwright.engine.intake import Unit
from batchwright.engine.paged import PagedCache
from batchwright.engine.prefix import PrefixBlocks, first_blocks, prefix_blocks
from batchwright.engine.prefix_attention import CachedPrompts
from batchwright.engine.prefix_attention import plan as plan_cached
from batchwright.engine.slots import Slots


@dataclass(eq=False)
class Placement:
    """A prompt prefilled into the blocks of `slots[0]`; `slots` holds one slot per
    candidate until the first token shows which candidates keep running."""

    unit: Unit
    slots: list[int]
    length: int  # prompt tokens
    total: int  # prompt plus the most tokens a candidate may generate
    dest: list[int]  # flat pool position of each prompt token the prefill computes
    cached: int = 0  # leading prompt tokens already in the cache (prefix.py)

    @property
    def slot(self) -> int:
        return self.slots[0]


def place(
    cache: PagedCache, slots: Slots, units: list[Unit], prefix: PrefixBlocks | None = None
) -> list[Placement]:
    """Admission already checked that slots and blocks suffice (Intake.admit). With a
    prefix index, a prompt's cached full blocks are shared and the rest allocated."""
    out = []
    for u in units:
        taken = slots.take(len(u.seqs))
        length = len(u.prompt)
        job = u.job
        total = length + min(job.req.max_tokens, job.context_length - length)
        if prefix is None:
            cache.assign(taken[0], cache.alloc.allocate(cache.alloc.blocks_for(total)))
            cached = 0
        else:
            blocks, cached = prefix_blocks(
                prefix, u.prompt, total, first_blocks(prefix, u), job.adapter_key
            )
            cache.assign(taken[0], blocks)
            job.cached_tokens.setdefault(u.prompt_index, cached)
        dest = cache.prompt_dest(taken[0], length)[cached:]
        out.append(Placement(u, taken, length, total, dest, cached))
    return out


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
