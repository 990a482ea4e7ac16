"""Batch slots: the per-row state a decode step reads, kept on the device.

Slot i is row i of every step. Its next token, cached length and liveness are device
tensors of `max_rows` rows (the sampler keeps its per-slot state the same way), written
in place when rows start, finish or move, never rebuilt; its block list and sequence are
host-side. A step runs over slots [0, rows): up to the highest live slot on CPU, a bucket
of fixed sizes on CUDA (shapes a CUDA graph can be captured for). Dead slots inside that
range compute a throw-away token that lands in the scratch block.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from batchwright.engine.kv.paged import PagedCache
from batchwright.engine.requests.jobs import Seq

# Row counts a CUDA step runs at (a captured graph per bucket); above the last, max_rows.
BUCKETS = (8, 16, 32, 64, 128, 256)


def bucket(rows: int, max_rows: int, fixed: bool) -> int:
    """Rows a step over `rows` live slots runs: exact, or with `fixed` shapes (CUDA,
    captured steps) the next bucket."""
    if not fixed or rows == 0:
        return rows
    return min(max_rows, next((b for b in BUCKETS if b >= rows), max_rows))


class Slots:
    def __init__(self, cache: PagedCache, max_rows: int, fixed: bool) -> None:
        dev = cache.device
        self.device = dev
        self.fixed = fixed  # steps run at bucket sizes (see `bucket`)
        self.max_rows = r = max_rows
        self.cache = cache
        self.tokens = torch.zeros(r, dtype=torch.long, device=dev)
        self.lens = torch.zeros(r, dtype=torch.long, device=dev)  # tokens in the cache
        self.alive = torch.zeros(r, dtype=torch.bool, device=dev)
        self.arange_int = torch.arange(r + 1, dtype=torch.int32, device=dev)
        self.seqs: list[Seq | None] = [None] * r
        self.hlen = [0] * r  # host copy of lens for live slots
        self._free = list(range(r))
        self.top = 0  # one past the highest slot in use
        self._pin = dev.type == "cuda"

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def live(self) -> int:
        return self.max_rows - len(self._free)

    def rows_for_step(self) -> int:
        return bucket(self.top, self.max_rows, self.fixed)

    # --- host -> device without waiting --------------------------------------------------

    def _host(self, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # Pinned and non-blocking on CUDA: the copy is queued behind the step, no sync.
        t = torch.tensor(values, dtype=dtype, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    def host_long(self, values: Sequence[int]) -> torch.Tensor:
        return self._host(values, torch.long)

    def host_int(self, values: Sequence[int]) -> torch.Tensor:
        return self._host(values, torch.int32)

    # --- slots ------------------------------------------------------------------------------

    def take(self, k: int) -> list[int]:
        out = [heapq.heappop(self._free) for _ in range(k)]
        self.top = max(self.top, max(out) + 1)
        return out

    def give(self, slots: Sequence[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)
        while self.top and self.seqs[self.top - 1] is None and (self.top - 1) in self._free:
            self.top -= 1

    def settle(self, taken: list[int], length: int, total: int, running: list[Seq]) -> list[int]:
        """Slots for the `running` candidates of a prompt of `length` tokens prefilled
        into the blocks of `taken[0]` (rows of `total` tokens at most); the rest of
        `taken` are freed."""
        cache = self.cache
        use, spare = taken[: len(running)], taken[len(running) :]
        if not running:
            cache.release(taken[0])
        bs = cache.block_size
        for dst in use[1:]:
            block = cache.fork(use[0], dst, length, total)
            if block is not None:
                cache.copy_block(cache.blocks[use[0]][length // bs], block)
        for slot, seq in zip(use, running, strict=True):
            self.seqs[slot] = seq
            self.hlen[slot] = length
        self.give(spare)
        return use

    def start(self, slots: list[int], tokens: torch.Tensor, rows: list[int]) -> None:
        """Device state of new rows in `slots`: their first tokens are `tokens[rows]`."""
        idx = self.host_long(slots)
        src = self.host_long(rows)
        self.tokens.index_copy_(0, idx, tokens.index_select(0, src))
        self.lens.index_copy_(0, idx, self.host_long([self.hlen[s] for s in slots]))
        self.alive.index_fill_(0, idx, True)
        self.cache.upload(slots, idx)

    def advance(self, n: int, tokens: torch.Tensor) -> None:
        """After a step: each live row's new token (ids as floats, the packed column) is
        its next input, one more cached."""
        self.tokens[:n].copy_(tokens)
        self.lens[:n].add_(self.alive[:n])

    def finish(self, slots: list[int]) -> None:
        """Rows leave: blocks released at once, device state reset (dead rows write to
        the scratch block and read nothing)."""
        for s in slots:
            self.seqs[s] = None
            self.cache.release(s)
        self._reset(self.host_long(slots))
        self.give(slots)

    def _reset(self, idx: torch.Tensor) -> None:
        self.alive.index_fill_(0, idx, False)
        self.lens.index_fill_(0, idx, 0)
        self.cache.table.index_fill_(0, idx, 0)

    def compactable(self) -> bool:
        """Whether `compact` would move rows (and the step then run fewer)."""
        return bucket(self.live, self.max_rows, self.fixed) < self.rows_for_step()

    def compact(self) -> tuple[list[int], list[int]] | None:
        """Move rows from the top into holes below so the step runs fewer rows (only the
        block-table rows and per-row state move, never keys or values). Returns the moves
        (sources, destinations) for the sampler's state."""
        live = self.live
        if not self.compactable():
            return None
        holes = sorted(s for s in self._free if s < live)
        movers = [s for s in range(self.top - 1, -1, -1) if self.seqs[s] is not None][: len(holes)]
        if not holes:
            return None
        dst, src = self.host_long(holes), self.host_long(movers)
        for t in (self.tokens, self.lens, self.alive, self.cache.table):
            t.index_copy_(0, dst, t.index_select(0, src))
        self._reset(src)
        for a, b in zip(movers, holes, strict=True):
            self.seqs[b], self.seqs[a] = self.seqs[a], None
            self.hlen[b] = self.hlen[a]
            self.cache.move(a, b)
        self._free = [s for s in self._free if s >= live] + movers
        heapq.heapify(self._free)
        self.top = live
        return movers, holes

    def release_all(self) -> None:
        """Give every block back (the run ended, or its consumer stopped early)."""
        for s, seq in enumerate(self.seqs):
            if seq is not None or self.cache.blocks[s]:
                self.seqs[s] = None
                if self.cache.blocks[s]:
                    self.cache.release(s)
