"""How a forward adds its tokens' adapter deltas (the delta of a token with no adapter is
not computed, or computed as an exact zero).

- `Grouped` (eager steps, the CPU default): the adapter tokens gathered into one padded
  block per adapter ([groups, longest, in]), then two batched matmuls against the groups'
  slot weights: shrink (A, all parts of a packed layer at once) and expand (B, per part),
  and the results added back to their tokens' rows. Work is in proportion to the adapter
  tokens and their ranks (the step's largest rank, zero-padded: exact), in a fixed number
  of ops per layer whatever the number of adapters.
- `Dense` (CUDA, compiled forwards and captured decode steps): every token against every
  slot's A ([tokens, slots * rank]), the columns of other slots zeroed by a mask built
  from the long-lived token index, then B. Shapes depend only on the token count and the
  configuration, and it reads only long-lived tensors, as a graph replay needs; the extra
  products cost little on a GPU, where a decode step is bound by reading the weights.
- `Single` (a whole forward under one adapter: echo scoring): the adapter's own tensors,
  computed as PEFT computes them: `lora_B(lora_A(x)) * scaling`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from batchwright.engine.lora.layers import LoraLinear, LoraState, flat


class Grouped:
    # Padding the groups to the longest may waste this share of the block's rows before
    # the groups run one by one instead.
    PAD_WASTE = 1.25

    def __init__(
        self,
        groups: Sequence[tuple[int, Sequence[int]]],
        rank: int,
        device: torch.device,
    ) -> None:
        """`groups`: (slot, token positions) per adapter in the step; `rank`: the largest
        rank among them."""
        self.slots = [s for s, _ in groups]
        sizes = [len(p) for _, p in groups]
        self.longest = longest = max(sizes)
        self.rank = rank
        # Slots 0..G-1 in order: the stacks are read as they are (no gather).
        self.leading = self.slots == list(range(len(self.slots)))
        # Padding rows repeat their group's first token; their products are zeroed
        # (`mask`), so adding them back to that token adds exact zeros.
        padded = [t for _, p in groups for t in (*p, *([p[0]] * (longest - len(p))))]
        pin = device.type == "cuda"

        def upload(values: Sequence[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype, pin_memory=pin)
            return t.to(device, non_blocking=True)

        self.device = device
        self.gslots = upload(self.slots)
        self.rows = upload(padded)
        self.mask: torch.Tensor | None = None
        if any(n != longest for n in sizes):
            keep = [float(j < n) for n in sizes for j in range(longest)]
            self.mask = upload(keep, torch.float32).view(len(groups), longest, 1)
        # Groups of very different sizes (a step admitting long prompts) would pad most of
        # the block: then each group runs on its own rows (a loop of plain matmuls).
        self.each: list[tuple[int, torch.Tensor]] | None = None
        if len(groups) > 1 and len(groups) * longest > self.PAD_WASTE * sum(sizes):
            self.each = [(s, upload(list(p))) for s, p in groups]
        self._cols: dict[tuple[int, int], torch.Tensor] = {}

    def _rank_cols(self, parts: int, cap: int) -> torch.Tensor | None:
        """Columns of the stacks within the step's rank (None: all of them)."""
        if self.rank >= cap:
            return None
        key = (parts, cap)
        if key not in self._cols:
            cols = [i * cap + j for i in range(parts) for j in range(self.rank)]
            self._cols[key] = torch.tensor(cols, device=self.device)
        return self._cols[key]

    def _stacks(self, layer: LoraLinear) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's slots' A^T [groups, in, parts * r] and block B [groups, parts * r,
        out]."""
        assert layer.at is not None and layer.bd is not None
        g = len(self.slots)
        if self.leading:
            at, bd = layer.at[:g], layer.bd[:g]
        else:
            at, bd = layer.at[self.gslots], layer.bd[self.gslots]
        cols = self._rank_cols(len(layer.slices), layer.rank)
        if cols is not None:
            at, bd = at.index_select(2, cols), bd.index_select(1, cols)
        return at, bd

    def apply(self, layer: LoraLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not any(layer.targeted[s] for s in self.slots):
            return y
        x2, y2 = flat(x, y)
        if self.each is not None:
            return self._each(layer, x2, y2, y)
        at, bd = self._stacks(layer)
        xg = x2.index_select(0, self.rows).view(len(self.slots), self.longest, -1)
        h = torch.bmm(xg, at)  # [groups, longest, parts * r]
        if self.mask is not None:
            h = h.mul_(self.mask.to(h.dtype))
        d = torch.bmm(h, bd)  # [groups, longest, out]: every part's delta at once
        y2.index_add_(0, self.rows, d.view(-1, y2.shape[-1]))
        return y

    def _each(
        self, layer: LoraLinear, x2: torch.Tensor, y2: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        assert layer.at is not None and layer.bd is not None and self.each is not None
        cols = self._rank_cols(len(layer.slices), layer.rank)
        for slot, rows in self.each:
            if not layer.targeted[slot]:
                continue
            at, bd = layer.at[slot], layer.bd[slot]
            if cols is not None:
                at, bd = at.index_select(1, cols), bd.index_select(0, cols)
            y2.index_add_(0, rows, (x2.index_select(0, rows) @ at) @ bd)
        return y


class Dense:
    def __init__(self, state: LoraState) -> None:
        self.state = state

    def apply(self, layer: LoraLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        st = self.state
        assert layer.a is not None and st.index is not None and st.slot_ids is not None
        x2, y2 = flat(x, y)
        tokens = x2.shape[0]
        mask = (st.index[:tokens, None] == st.slot_ids[None, :]).to(x2.dtype)  # [T, slots]
        slots, n, cap = layer.a.shape[0], len(layer.slices), layer.rank
        h = x2 @ layer.a.view(slots * n * cap, layer.in_features).t()
        h = h.view(tokens, slots, n, cap) * mask[:, :, None, None]
        for i, s in enumerate(layer.slices):
            hi = h[:, :, i, :].reshape(tokens, slots * cap)
            y2[:, s.start : s.end] += hi @ layer.b[i].view(slots * cap, s.end - s.start)
        return y


class Single:
    """One adapter's own tensors for every token: name -> (A [r, in], B [out, r], scaling)."""

    def __init__(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        self.tensors = tensors

    def apply(self, layer: LoraLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2, y2 = flat(x, y)
        for s in layer.slices:
            t = self.tensors.get(s.name)
            if t is not None:
                a, b, scaling = t
                y2[:, s.start : s.end] += F.linear(F.linear(x2, a), b) * scaling
        return y


def dense_state(state: LoraState, max_loras: int, tokens: int, device: torch.device) -> None:
    """The dense kernel's long-lived tensors, allocated once for the longest forward
    (`tokens`): a captured graph keeps reading the index it was recorded with."""
    if state.slot_ids is None:
        state.slot_ids = torch.arange(1, max_loras + 1, device=device)
    if state.index is None:
        state.index = torch.zeros(tokens, dtype=torch.long, device=device)
