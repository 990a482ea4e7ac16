"""Shared-prefix reuse: full prompt blocks of the paged cache indexed by their tokens.

A tree over token ids with one block per edge (a radix tree cut at block boundaries): the
children of a node are keyed by the `block_size` token ids of the next block, so a
prompt's cached prefix is found by walking from the root, and a match is exact (token
tuples are compared, not only hashed). Only full prompt blocks are indexed: their keys and
values depend on nothing but the tokens up to their end, and no row writes into them
again. The index is part of the block allocator, not a second cache: a matched block gets
one more reference like the prompt blocks `n`/`best_of` candidates share, and a cached
block nobody references stays indexed on an LRU list of idle blocks. Idle blocks count as
free: a fresh allocation takes never-indexed blocks first and then evicts the least
recently released idle ones (with what hangs below them in the tree). At most
`max_idle` blocks stay idle (the registry's `prefix_cache_tokens`), which bounds the
memory a CPU worker keeps resident for prefixes nobody asked for again.

Blocks are indexed when a prompt is placed, before its prefill runs: a prompt admitted
in the same step can match them, because every layer writes the step's keys and values
into the pages before any attention reads them (attention.py).

The keys and values of a LoRA adapter's rows are the adapter's own (its deltas change
every layer's k and v), so each adapter has a tree of its own (`space`: the adapter's
key, engine/lora/; None for the base model): the same prompt under two adapters, or
under an adapter and the base, never shares a block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchwright.engine.kv.blocks import SCRATCH, BlockAllocator, OutOfBlocks
from batchwright.engine.kv.paged import PagedCache
from batchwright.registry import ModelSpec

if TYPE_CHECKING:
    from batchwright.engine.requests.jobs import Unit

Key = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    block: int
    key: Key
    parent: _Node | None
    children: dict[Key, _Node] = field(default_factory=dict)


class PrefixBlocks(BlockAllocator):
    """A block allocator whose full prompt blocks stay reusable after their rows end."""

    def __init__(self, num_blocks: int, block_size: int, max_idle: int) -> None:
        super().__init__(num_blocks, block_size)
        self.max_idle = max(0, max_idle)
        self._roots: dict[Hashable, _Node] = {None: _Node(SCRATCH, (), None)}
        self._nodes: dict[int, _Node] = {}  # indexed block -> its node
        self._idle: OrderedDict[int, None] = OrderedDict()  # indexed, unreferenced; LRU first

    # --- the allocator, with idle indexed blocks counted as free ----------------------------

    @property
    def free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - self.free

    @property
    def cached(self) -> int:
        """Blocks in the index (in use or idle)."""
        return len(self._nodes)

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise OutOfBlocks(f"{n} blocks asked for, {self.free} free")
        out = []
        for _ in range(n):
            if not self._free:
                self._evict_lru()
            b = self._free.pop()
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: Iterable[int]) -> list[int]:
        out = list(blocks)
        for b in out:
            if self._refs[b] <= 0:
                if b not in self._idle:
                    raise ValueError(f"block {b} is not allocated")
                del self._idle[b]
            self._refs[b] += 1
        return out

    def release(self, blocks: Iterable[int]) -> None:
        # Last block first: a row's deepest blocks become the least recently used, so
        # eviction trims prefixes from their ends.
        for b in reversed(list(blocks)):
            refs = self._refs[b]
            if refs <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self._refs[b] = refs - 1
            if refs == 1:
                if b in self._nodes:
                    self._idle[b] = None
                else:
                    self._free.append(b)
        while len(self._idle) > self.max_idle:
            self._evict_lru()

    def _evict_lru(self) -> None:
        block = next(iter(self._idle))
        node = self._nodes[block]
        assert node.parent is not None
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            del self._nodes[x.block]
            if x.block in self._idle:
                del self._idle[x.block]
                self._free.append(x.block)
            # A descendant still referenced (a row that recomputed a block this tree
            # already had) just stops being indexed; its row frees it as usual.

    # --- the index ---------------------------------------------------------------------------

    def _keys(self, tokens: Sequence[int], blocks: int) -> list[Key]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(blocks)]

    def _root(self, space: Hashable) -> _Node:
        root = self._roots.get(space)
        if root is None:
            root = self._roots[space] = _Node(SCRATCH, (), None)
        return root

    def match(
        self, tokens: Sequence[int], most: int | None = None, space: Hashable = None
    ) -> list[int]:
        """Indexed blocks holding the longest cached prefix of `tokens` in `space` (the
        adapter's; None: the base's), in order, at most `most` of them; at least the last
        token is left out (its logits are what the prefill is for)."""
        out: list[int] = []
        node = self._roots.get(space)
        if node is None:
            return out
        blocks = (len(tokens) - 1) // self.block_size
        for key in self._keys(tokens, blocks if most is None else min(most, blocks)):
            child = node.children.get(key)
            if child is None:
                break
            out.append(child.block)
            node = child
        return out

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], space: Hashable = None) -> None:
        """Index the full blocks of a prompt placed in `blocks` (its own or matched)."""
        node = self._root(space)
        for key, b in zip(self._keys(tokens, len(tokens) // self.block_size), blocks, strict=False):
            child = node.children.get(key)
            if child is None:
                if b in self._nodes:  # already indexed under another prefix: cannot be
                    return
                child = node.children[key] = self._nodes[b] = _Node(b, key, node)
            node = child


class Planned:
    """Admission costs of prompts whose prefix the index, or a prompt admitted earlier in
    the same step, already holds: only the rest counts against the step's token budget and
    the free blocks (placement then matches the same blocks, in the same order)."""

    def __init__(self, index: PrefixBlocks, kv_cost: Callable[[Unit], int]) -> None:
        self.index = index
        self.kv_cost = kv_cost
        # Hash chains of the full blocks of prompts admitted this step. A collision can
        # only misjudge a budget, never reuse: placement compares tokens.
        self._coming: set[int] = set()
        self._last: tuple[Sequence[int], int, int] | None = None

    def _plan(self, unit: Unit) -> tuple[int, int]:
        """(blocks the prefill will find cached, how many of those are idle now), and
        the prompt's blocks recorded as coming."""
        index = self.index
        prompt = unit.prompt
        most = first_blocks(index, unit)
        limit = (len(prompt) - 1) // index.block_size
        if most is not None:
            limit = min(limit, most)
        space = unit.job.adapter_key
        matched = index.match(prompt, most, space)
        cached = len(matched)
        chain = hash(space)
        for i, key in enumerate(index._keys(prompt, len(prompt) // index.block_size)):
            chain = hash((chain, key))
            if i == cached and i < limit and chain in self._coming:
                cached += 1
            self._coming.add(chain)
        return cached, sum(1 for b in matched if index.refs(b) == 0)

    def tokens(self, unit: Unit) -> int:
        """Prompt tokens the unit's prefill computes (called first for each unit)."""
        cached, idle = self._plan(unit)
        self._last = (unit.prompt, cached, idle)
        return len(unit.prompt) - cached * self.index.block_size

    def blocks(self, unit: Unit) -> int:
        """Blocks the unit takes from the free ones: cached blocks in use cost nothing,
        idle ones leave the free list."""
        if self._last is None or self._last[0] is not unit.prompt:
            self.tokens(unit)
        assert self._last is not None
        _, cached, idle = self._last
        return self.kv_cost(unit) - cached + idle


def first_blocks(index: PrefixBlocks, unit: Unit) -> int | None:
    """The most cached blocks the unit's prefill may use: for a preempted line coming back,
    what its first prefill found (preempt.py). Its own prompt blocks are usually still
    cached, but a prefill that reads a prefix through its pages computes the rest of the
    prompt in another kernel than one that computes it whole, with other rounding, and a
    greedy or seeded line must give the text it would have had (an argmax near a tie
    flipped on 2 of 20,000 lines in bench/online_bench.py)."""
    if not unit.job.requeued:
        return None
    first = unit.job.cached_tokens.get(unit.prompt_index)
    return None if first is None else first // index.block_size


def prefix_blocks(
    index: PrefixBlocks,
    prompt: Sequence[int],
    total: int,
    most: int | None = None,
    space: Hashable = None,
) -> tuple[list[int], int]:
    """Blocks for a row of `total` tokens starting with `prompt`: its cached prefix (at
    most `most` blocks) in `space` (its adapter's) shared (taken off the idle list first,
    so the allocation cannot evict it), the rest new; the prompt's full blocks are then
    indexed. Returns the blocks and the cached tokens."""
    matched = index.share(index.match(prompt, most, space))
    blocks = matched + index.allocate(index.blocks_for(total) - len(matched))
    index.insert(prompt, blocks, space)
    return blocks, len(matched) * index.block_size


def attach(cache: PagedCache, idle_tokens: int) -> PrefixBlocks:
    """Swap the cache's allocator (nothing allocated yet) for one with a prefix index."""
    assert cache.alloc.used == 0
    index = PrefixBlocks(cache.alloc.num_blocks, cache.block_size, idle_tokens // cache.block_size)
    cache.alloc = index
    return index


def enabled(spec: ModelSpec, varlen: bool, cache: PagedCache) -> PrefixBlocks | None:
    """The run's prefix index, or None: turned off in the registry, or a model on the
    padded path (`varlen` false: its prefill recomputes whole prompts)."""
    if not spec.prefix_cache or not varlen:
        return None
    idle = spec.prefix_cache_tokens
    if idle is None:
        idle = cache.alloc.num_blocks * cache.block_size if cache.device.type == "cuda" else 8192
    return attach(cache, idle)


def admission_costs(
    index: PrefixBlocks | None, kv_cost: Callable[[Unit], int]
) -> tuple[Callable[[Unit], int], Callable[[Unit], int] | None]:
    """(blocks, prompt tokens) of a unit for one admission round (Intake.admit)."""
    if index is None:
        return kv_cost, None
    planned = Planned(index, kv_cost)
    return planned.blocks, planned.tokens
