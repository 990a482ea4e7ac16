"""`max_loras` adapter slots on the device, least recently used out.

A slot holds one adapter's weights in every wrapped layer's stacks (layers.py): its A
rows and its B (times the scaling, transposed) for the parts it targets, zeros elsewhere
and past its rank, so that a kernel may read any slot at the stacks' full rank and add
exact zeros. Two layouts, by kernel (kernels.py): the dense kernel's (`a`, and `b` per
part) and the grouped kernel's (`at`: A transposed, parts side by side; `bd`: the parts'
B block-diagonal over the whole output, so one batched matmul expands every part). The
stacks are allocated when the first adapter is loaded: a model whose lines never name an
adapter keeps no memory for them. An adapter in use by a running
row (or admitted in the current round) is pinned: it is never evicted, and a row whose
adapter finds every slot pinned waits for one (run.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Set

import torch

from batchwright.engine.lora.layers import LoraLinear
from batchwright.engine.lora.weights import AdapterWeights


class LoraSlots:
    def __init__(
        self,
        layers: list[LoraLinear],
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.held: OrderedDict[Hashable, int] = OrderedDict()  # adapter key -> slot, LRU first
        self.names: dict[int, str] = {}  # slot -> adapter name
        self.ranks: dict[int, int] = {}  # slot -> its adapter's largest rank
        self._free = list(range(max_loras - 1, -1, -1))
        self.loads = 0  # adapters copied into a slot (tests and benches read it)
        self.allocated = False
        self.dense = False  # the layout: dense kernel's, else grouped (set before loading)

    def _allocate(self) -> None:
        r, s = self.max_rank, self.max_loras
        dev, dt = self.device, self.dtype
        for layer in self.layers:
            n, i, o = len(layer.slices), layer.in_features, layer.out_features
            if self.dense:
                layer.a = torch.zeros(s, n * r, i, device=dev, dtype=dt)
                layer.b = [
                    torch.zeros(s, r, x.end - x.start, device=dev, dtype=dt) for x in layer.slices
                ]
            else:
                layer.at = torch.zeros(s, i, n * r, device=dev, dtype=dt)
                layer.bd = torch.zeros(s, n * r, o, device=dev, dtype=dt)
            layer.rank = r
            layer.targeted = [frozenset()] * s
        self.allocated = True

    def slot(self, key: Hashable) -> int | None:
        return self.held.get(key)

    def acquire(self, weights: AdapterWeights, pinned: Set[Hashable]) -> int | None:
        """The adapter's slot, loading it into a free one or the least recently used one
        not `pinned`; None when every slot is pinned."""
        key = weights.key
        slot = self.held.get(key)
        if slot is not None:
            self.held.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k in self.held if k not in pinned), None)
            if victim is None:
                return None
            slot = self.held.pop(victim)
        self._load(slot, weights)
        self.held[key] = slot
        self.names[slot] = weights.name
        self.ranks[slot] = weights.rank
        return slot

    def _load(self, slot: int, weights: AdapterWeights) -> None:
        if not self.allocated:
            self._allocate()
        self.loads += 1
        r = self.max_rank
        for layer in self.layers:
            if self.dense:
                assert layer.a is not None
                layer.a[slot].zero_()
                for b_i in layer.b:
                    b_i[slot].zero_()
            else:
                assert layer.at is not None and layer.bd is not None
                layer.at[slot].zero_()
                layer.bd[slot].zero_()
            parts = []
            for i, s in enumerate(layer.slices):
                t = weights.tensors.get(s.name)
                if t is None:
                    continue
                a, b, scaling = t
                rank, lo = a.shape[0], i * r
                if self.dense:
                    assert layer.a is not None
                    layer.a[slot, lo : lo + rank].copy_(a)
                    layer.b[i][slot, :rank].copy_((b * scaling).t())
                else:
                    assert layer.at is not None and layer.bd is not None
                    layer.at[slot, :, lo : lo + rank].copy_(a.t())
                    layer.bd[slot, lo : lo + rank, s.start : s.end].copy_((b * scaling).t())
                parts.append(i)
            targeted = list(layer.targeted)
            targeted[slot] = frozenset(parts)
            layer.targeted = targeted

    def forget(self, keys: Set[Hashable], pinned: Set[Hashable]) -> None:
        """Free the slots of adapters that were removed (unless a running row uses one:
        it frees with the LRU later)."""
        for key in [k for k in self.held if k in keys and k not in pinned]:
            slot = self.held.pop(key)
            self.names.pop(slot, None)
            self._free.append(slot)

    def loaded(self) -> list[str]:
        return sorted(self.names[s] for s in self.held.values())
