"""A left-padded, row-addressable KV cache for the decode batch.

transformers' DynamicCache appends with `torch.cat` on every step, which copies the whole
cache each token. `_GrowLayer` keeps a buffer with headroom and writes in place instead.
Rows are left-padded: every row's newest token sits in the last column, so one decode step
appends one column for all rows; a row's padding is masked out and its RoPE positions are
passed explicitly, so padding never changes its logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Spare columns allocated when a buffer is full or rebuilt: at least _HEADROOM, or this
# share of the columns in use, so that a growing cache is copied a few times, not every
# _HEADROOM steps (each copy moves every row of every layer).
_HEADROOM = 64
_GROWTH = 0.5


def _spare(columns: int) -> int:
    return max(_HEADROOM, int(columns * _GROWTH))


class _GrowLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A DynamicLayer that appends in place into a buffer with spare columns."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()  # type: ignore[no-untyped-call]
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._used = 0
        if keys is not None and values is not None:
            self._set(keys, values)

    def _set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.device = keys.device
        self.is_initialized = True
        self._kbuf, self._vbuf, self._used = keys, values, keys.shape[-2]
        self.keys, self.values = keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._set(key_states[..., :0, :], value_states[..., :0, :])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._kbuf is not None and self._vbuf is not None
        n = key_states.shape[-2]
        need = self._used + n
        if need > self._kbuf.shape[-2]:
            b, h, _, d = self._kbuf.shape
            cap = need + _spare(need)
            kbuf = self._kbuf.new_empty((b, h, cap, d))
            vbuf = self._vbuf.new_empty((b, h, cap, self._vbuf.shape[-1]))
            kbuf[..., : self._used, :] = self._kbuf[..., : self._used, :]
            vbuf[..., : self._used, :] = self._vbuf[..., : self._used, :]
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[..., self._used : need, :] = key_states
        self._vbuf[..., self._used : need, :] = value_states
        self._used = need
        self.keys = self._kbuf[..., :need, :]
        self.values = self._vbuf[..., :need, :]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    """An empty cache whose layers are created lazily by the model's first forward."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = _GrowLayer
    return cache


def _from_layers(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = _GrowLayer
    cache.layers = [_GrowLayer(k, v) for k, v in kv]
    return cache


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert keys is not None and values is not None, "only attention KV layers are supported"
        out.append((keys, values))
    return out


def _with_headroom(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in a buffer with spare columns (only the first t.shape[-2] are used).

    Rebuilt caches would otherwise be exactly full and reallocate on the very next step.
    """
    b, h, n, d = t.shape
    buf = t.new_empty((b, h, n + _spare(n), d))
    buf[..., :n, :] = t
    return buf


def _from_buffers(kv: list[tuple[torch.Tensor, torch.Tensor]], used: int) -> DynamicCache:
    cache = new_cache()
    layers: list[Any] = []
    for kbuf, vbuf in kv:
        layer = _GrowLayer(kbuf[..., :used, :], vbuf[..., :used, :])
        layer._kbuf, layer._vbuf = kbuf, vbuf
        layers.append(layer)
    cache.layers = layers
    return cache


class BatchCache:
    """KV cache + attention mask ([rows, columns], 1 = real token) of the decode batch.

    Rows are slots: a finished row is masked out ("dead") and a new row is written into
    its slot in place, so the steady state never copies the whole cache. `compact` drops
    dead rows and all-padding leading columns when that is worth a copy.
    """

    def __init__(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def columns(self) -> int:
        return int(self.mask.shape[1])

    def dead_prefix(self) -> int:
        """Leading columns that are padding for every row."""
        live = self.mask.any(dim=0)
        if not bool(live.any()):
            return self.columns
        return int(live.to(torch.int8).argmax())

    def headroom(self) -> int:
        """Columns that can still be appended without reallocating."""
        room = [
            layer._kbuf.shape[-2] - layer._used
            for layer in self.cache.layers
            if isinstance(layer, _GrowLayer) and layer._kbuf is not None
        ]
        return min(room, default=_HEADROOM)

    def compact(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices), then drop columns that are padding for every row."""
        self.mask = self.mask.index_select(0, rows)
        first = self.dead_prefix()
        kv = []
        for k, v in _kv(self.cache):
            kv.append(
                (
                    _with_headroom(k[..., first:, :].index_select(0, rows)),
                    _with_headroom(v[..., first:, :].index_select(0, rows)),
                )
            )
        self.mask = self.mask[:, first:]
        self.cache = _from_buffers(kv, self.columns)

    def swap(self, i: int, j: int, width: int) -> None:
        """Exchange rows i and j; only their last `width` columns (their real tokens) move."""
        cols = self.columns
        a = torch.tensor([i, j], device=self.mask.device)
        b = torch.tensor([j, i], device=self.mask.device)
        for layer in self.cache.layers:
            assert isinstance(layer, _GrowLayer) and layer._kbuf is not None
            assert layer._vbuf is not None
            for buf in (layer._kbuf, layer._vbuf):
                region = buf[:, :, cols - width : cols]
                region[a] = region[b]
        self.mask[a] = self.mask[b]

    def kill(self, rows: list[int]) -> None:
        self.mask[rows] = 0

    def append_column(self) -> torch.Tensor:
        """Mask for a decode step: the existing columns plus one new token per row."""
        ones = self.mask.new_ones((self.rows, 1))
        self.mask = torch.cat([self.mask, ones], dim=1)
        return self.mask

    def _widen(self, width: int) -> None:
        """Left-pad every row so the cache has at least `width` columns."""
        extra = width - self.columns
        if extra <= 0:
            return
        kv = [
            (_with_headroom(F.pad(k, (0, 0, extra, 0))), _with_headroom(F.pad(v, (0, 0, extra, 0))))
            for k, v in _kv(self.cache)
        ]
        self.mask = F.pad(self.mask, (extra, 0))
        self.cache = _from_buffers(kv, self.columns)

    def fill(self, slots: list[int], part: BatchCache) -> None:
        """Write `part`'s rows into dead `slots`, right-aligned with the batch."""
        self._widen(part.columns)
        width, cols = part.columns, self.columns
        index = torch.tensor(slots, device=self.mask.device)
        for layer, (k2, v2) in zip(self.cache.layers, _kv(part.cache), strict=True):
            assert isinstance(layer, _GrowLayer) and layer._kbuf is not None
            assert layer._vbuf is not None
            layer._kbuf[index, :, cols - width : cols, :] = k2
            layer._vbuf[index, :, cols - width : cols, :] = v2
        self.mask[index] = 0
        self.mask[index, cols - width :] = part.mask

    def merge(self, other: BatchCache) -> None:
        """Append `other`'s rows as new slots, left-padding whichever side is shorter."""
        if self.rows == 0:
            self.cache, self.mask = other.cache, other.mask
            return
        width = max(self.columns, other.columns)

        def lpad(t: torch.Tensor, cols: int) -> torch.Tensor:
            # KV tensors pad dim -2 (columns), the mask pads its last dim.
            pad = [0, 0, width - cols, 0] if t.dim() == 4 else [width - cols, 0]
            return F.pad(t, pad) if width > cols else t

        kv = []
        for (k1, v1), (k2, v2) in zip(_kv(self.cache), _kv(other.cache), strict=True):
            k = torch.cat([lpad(k1, self.columns), lpad(k2, other.columns)], dim=0)
            v = torch.cat([lpad(v1, self.columns), lpad(v2, other.columns)], dim=0)
            kv.append((_with_headroom(k), _with_headroom(v)))
        self.mask = torch.cat([lpad(self.mask, self.columns), lpad(other.mask, other.columns)])
        self.cache = _from_buffers(kv, width)

    @classmethod
    def unpack(
        cls, packed: list[tuple[torch.Tensor, torch.Tensor]], bounds: list[tuple[int, int]]
    ) -> BatchCache:
        """One left-padded row per [start, end) segment of packed single-row keys/values
        (one pair per layer)."""
        width = max(e - s for s, e in bounds)
        kv = []
        for k, v in packed:
            k2 = k.new_zeros((len(bounds), k.shape[1], width, k.shape[3]))
            v2 = v.new_zeros((len(bounds), v.shape[1], width, v.shape[3]))
            for i, (s, e) in enumerate(bounds):
                k2[i, :, width - (e - s) :] = k[0, :, s:e]
                v2[i, :, width - (e - s) :] = v[0, :, s:e]
            kv.append((k2, v2))
        dev = packed[0][0].device
        lens = torch.tensor([e - s for s, e in bounds], device=dev)
        mask = (torch.arange(width, device=dev)[None, :] >= (width - lens)[:, None]).long()
        return cls(_from_layers(kv), mask)

    def expand(self, index: torch.Tensor) -> BatchCache:
        """A new cache whose row i is this cache's row index[i] (n / best_of candidates)."""
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in _kv(self.cache)]
        return BatchCache(_from_layers(kv), self.mask.index_select(0, index))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of a freshly prefilled part (no headroom needed yet)."""
        kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in _kv(self.cache)]
        self.cache = _from_layers(kv)
        self.mask = self.mask.index_select(0, rows)


def empty_batch(device: torch.device) -> BatchCache:
    return BatchCache(new_cache(), torch.zeros((0, 0), dtype=torch.long, device=device))
