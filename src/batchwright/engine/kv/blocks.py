"""Fixed-size KV blocks: a free list with reference counts.

A block holds `block_size` tokens' keys and values in every layer (paged.py owns the
memory; this module only hands out block numbers). A block may be referenced by several
rows: the `n`/`best_of` candidates of one prompt share its full prompt blocks, and rows
whose prompts start alike share a cached prefix's (prefix.py, whose allocator keeps such
blocks indexed after their rows end). A block returns to the free list when its last
reference goes. Block 0 is never handed out: rows with nothing to write (dead slots of a
fixed-shape step) write there.
"""

from __future__ import annotations

from collections.abc import Iterable

SCRATCH = 0


class OutOfBlocks(RuntimeError):
    """More blocks asked for than are free: admission must check `free` first."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a paged cache needs at least two blocks (one is scratch)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Popped from the end: the lowest numbers go first, and a freed block is the next
        # one handed out (memory already touched stays in use; on CPU untouched pages of
        # the pool are never made resident).
        self._free = list(range(num_blocks - 1, SCRATCH, -1))
        self._refs = [0] * num_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked for, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: Iterable[int]) -> list[int]:
        """One more reference to each of `blocks` (returned, for chaining)."""
        out = list(blocks)
        for b in out:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1
        return out

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each of `blocks`; blocks nobody references are free."""
        for b in blocks:
            refs = self._refs[b]
            if refs <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self._refs[b] = refs - 1
            if refs == 1:
                self._free.append(b)

    def refs(self, block: int) -> int:
        return self._refs[block]
