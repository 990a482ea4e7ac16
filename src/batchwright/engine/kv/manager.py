"""The KV manager: where rows' keys and values go, and how many tokens a row may generate.

One per loaded model (it lives as long as the pools: a prefix cached in one run is found in
the next). It owns the paged cache, its allocator (with the prefix index when prefix reuse
is on), the cost of admitting a prompt in blocks, the placement of admitted prompts, and
the most tokens a candidate may generate (`max_new`, the one bound): admission costs and
placement reserve blocks for it, and placement gives it to each candidate, which ends
("length") when it reaches it (requests/jobs.py's `Seq.push`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchwright.engine.kv import prefix
from batchwright.engine.kv.paged import PagedCache
from batchwright.engine.kv.prefix import PrefixBlocks, first_blocks, prefix_blocks
from batchwright.engine.requests.jobs import Unit

Cost = Callable[[Unit], int]


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


class KVManager:
    def __init__(
        self, cache: PagedCache, index: PrefixBlocks | None = None, *, context_length: int
    ) -> None:
        self.cache = cache
        self.prefix = index
        self.context_length = context_length

    @property
    def free(self) -> int:
        """Blocks an admission may take now (idle prefix blocks count)."""
        return self.cache.alloc.free

    @property
    def usable(self) -> int:
        """Blocks a row may ever hold (all but the scratch block)."""
        return self.cache.alloc.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        return self.usable * self.cache.block_size

    def max_new(self, unit: Unit) -> int:
        """The most tokens a candidate of the unit's prompt may generate: max_tokens, or
        what the context leaves."""
        return min(unit.job.req.max_tokens, self.context_length - len(unit.prompt))

    def cost(self, unit: Unit) -> int:
        """Blocks the unit's rows reserve, with no prefix reuse counted."""
        new = self.max_new(unit)
        return self.cache.blocks_needed(len(unit.prompt), new, len(unit.seqs))

    def admission_costs(self) -> tuple[Cost, Cost | None]:
        """(blocks, prompt tokens computed) of a unit, for one admission round
        (Intake.admit): with prefix reuse, what the index or an earlier prompt of the same
        round already holds is not counted."""
        return prefix.admission_costs(self.prefix, self.cost)

    def place(self, units: list[Unit], take: Callable[[int], list[int]]) -> list[Placement]:
        """Slots (from `take`) and blocks for admitted units; admission checked that both
        suffice. With a prefix index, a prompt's cached full blocks are shared and the
        rest allocated. Each candidate is given its bound (`max_new`)."""
        cache = self.cache
        out = []
        for u in units:
            taken = take(len(u.seqs))
            length = len(u.prompt)
            job = u.job
            new = self.max_new(u)
            for seq in u.seqs:
                seq.max_new = new
            total = length + new
            if self.prefix is None:
                cache.assign(taken[0], cache.alloc.allocate(cache.alloc.blocks_for(total)))
                cached = 0
            else:
                index = self.prefix
                blocks, cached = prefix_blocks(
                    index, u.prompt, total, first_blocks(index, u), job.adapter_key
                )
                cache.assign(taken[0], blocks)
                job.cached_tokens.setdefault(u.prompt_index, cached)
            dest = cache.prompt_dest(taken[0], length)[cached:]
            out.append(Placement(u, taken, length, total, dest, cached))
        return out
