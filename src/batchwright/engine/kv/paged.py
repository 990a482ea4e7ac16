"""The paged KV cache: the engine's one cache structure, on every device.

Per layer one key pool and one value pool of `[blocks, block_size, kv_heads, head_dim]`
(the layout `torch.nn.attention.varlen.varlen_attn` reads through a block table). Each
batch slot owns a list of blocks (blocks.py hands them out, with reference counts), and
the device block table `[max_rows, max_blocks]` maps a slot's token i to block
`table[slot, i // block_size]`. Nothing is ever copied to grow: a row's blocks are
allocated when it is admitted, for its prompt plus the most tokens it may generate, so
the step never waits on the host to extend a table; finished rows release theirs at
once. `n`/`best_of` candidates share their prompt's full blocks (a partial last block is
copied per candidate), as rows share a cached prefix's blocks (prefix.py).
"""

from __future__ import annotations

import torch

from batchwright.engine.kv.blocks import SCRATCH, BlockAllocator

# Tokens per block. FlashAttention's paged kernel (CUDA) wants multiples of 256. On CPU
# the native kernel waits on memory at every jump to another block: 16-token blocks made
# decode attention about 2x slower than 64 (measured on this project's CPU bench model); 64 wastes
# at most 63 tokens of a row's last block.
BLOCK_SIZE = {"cuda": 256}
BLOCK_SIZE_DEFAULT = 64
# Share of the free device memory (after loading the weights) the pools may take on CUDA.
_CUDA_MEMORY_SHARE = 0.6


def block_size_for(device: torch.device, configured: int | None = None) -> int:
    return configured or BLOCK_SIZE.get(device.type, BLOCK_SIZE_DEFAULT)


def pool_blocks(
    *,
    kv_tokens: int | None,
    max_rows: int,
    context_length: int,
    block_size: int,
    token_bytes: int,
    device: torch.device,
) -> int:
    """Blocks in the pools (scratch included): the KV-token budget when configured; else
    enough for max_rows rows of full context, capped on CUDA by free memory. On CPU the
    pool is virtual memory that only becomes resident where tokens are written."""
    per_row = -(-context_length // block_size)
    if kv_tokens:
        return max(2, -(-kv_tokens // block_size) + 1)
    blocks = max_rows * per_row + 1
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fit = int(free * _CUDA_MEMORY_SHARE) // (block_size * token_bytes)
        blocks = max(per_row + 1, min(blocks, fit))
    return blocks


# A layer's (kv_heads, key dim, value dim): kv_shape.py reads them off the model.
LayerShape = tuple[int, int, int]


class PagedCache:
    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        max_rows: int,
        context_length: int,
        shapes: list[LayerShape] | None = None,
    ) -> None:
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.device = device
        # Per layer, as the model projects them (a layer's heads and widths may differ
        # from the config's and from each other: kv_shape.py); else one shape for all.
        shapes = shapes or [(kv_heads, head_dim, head_dim)] * layers
        self.keys = [
            torch.empty((num_blocks, block_size, h, dk), dtype=dtype, device=device)
            for h, dk, _ in shapes
        ]
        self.values = [
            torch.empty((num_blocks, block_size, h, dv), dtype=dtype, device=device)
            for h, _, dv in shapes
        ]
        for pool in (*self.keys, *self.values):
            pool[SCRATCH].zero_()
        self.max_blocks = -(-context_length // block_size)
        self.table = torch.zeros((max_rows, self.max_blocks), dtype=torch.int32, device=device)
        self.blocks: list[list[int]] = [[] for _ in range(max_rows)]

    @property
    def capacity(self) -> int:
        """Tokens a row's table can hold: a sliding window this long never binds."""
        return self.max_blocks * self.block_size

    # --- host side: block lists ----------------------------------------------------------

    def blocks_needed(self, prompt: int, new_tokens: int, candidates: int) -> int:
        """Blocks a prompt's candidates take: full prompt blocks once, the rest each."""
        bs = self.block_size
        shared = prompt // bs if candidates > 1 else 0
        own = -(-(prompt - shared * bs + new_tokens) // bs)
        return shared + candidates * own

    def assign(self, slot: int, blocks: list[int]) -> None:
        self.blocks[slot] = blocks

    def release(self, slot: int) -> None:
        self.alloc.release(self.blocks[slot])
        self.blocks[slot] = []

    def fork(self, src: int, dst: int, prompt: int, total: int) -> int | None:
        """Blocks for slot `dst`, a candidate of the prompt prefilled into slot `src`
        (`total` tokens at most): the full prompt blocks are shared, the rest allocated.
        Returns the block of `dst` that needs a copy of `src`'s partial prompt block."""
        full = prompt // self.block_size
        own = self.alloc.allocate(self.alloc.blocks_for(total) - full)
        self.blocks[dst] = self.alloc.share(self.blocks[src][:full]) + own
        return own[0] if prompt % self.block_size else None

    def move(self, src: int, dst: int) -> None:
        self.blocks[dst], self.blocks[src] = self.blocks[src], []

    # --- device side -----------------------------------------------------------------------

    def host_rows(self, slots: list[int]) -> torch.Tensor:
        """Block-table rows of `slots` built from their host block lists, on the device."""
        rows = torch.zeros((len(slots), self.max_blocks), dtype=torch.int32)
        for i, s in enumerate(slots):
            rows[i, : len(self.blocks[s])] = torch.as_tensor(self.blocks[s], dtype=torch.int32)
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return rows.to(self.device, non_blocking=True)

    def upload(self, slots: list[int], index: torch.Tensor) -> None:
        """Write the block lists of `slots` into the device table (admission steps)."""
        self.table.index_copy_(0, index, self.host_rows(slots))

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (*self.keys, *self.values):
            pool[dst] = pool[src]

    def prompt_dest(self, slot: int, length: int) -> list[int]:
        """Flat pool positions (block * block_size + offset) of a prompt's tokens."""
        bs, blocks = self.block_size, self.blocks[slot]
        return [blocks[p // bs] * bs + p % bs for p in range(length)]

    def decode_dest(self, lens: torch.Tensor) -> torch.Tensor:
        """Flat pool position of each row's next token (device); dead rows write to the
        scratch block, so a fixed-shape step never touches a live row's blocks."""
        bs, n = self.block_size, lens.shape[0]
        blk = self.table[:n].gather(1, (lens // bs)[:, None])[:, 0]
        # A dead row has length 0 and a zeroed table row: position 0 of the scratch block.
        return torch.add(lens % bs, blk, alpha=bs)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, dest: torch.Tensor) -> None:
        """Store `key`/`value` [tokens, kv_heads, dim] at the flat positions `dest`."""
        k, v = self.keys[layer], self.values[layer]
        k.view(-1, k.shape[2], k.shape[3]).index_copy_(0, dest, key)
        v.view(-1, v.shape[2], v.shape[3]).index_copy_(0, dest, value)
