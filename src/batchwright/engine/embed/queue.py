"""Which inputs go into the next forward: online ones first, then batch inputs packed by
length around the oldest input of the group (batch) served least.

Inputs wait flattened (a request of 2,048 inputs is 2,048 of them) and in arrival order.
Each forward takes up to `max_batch_tokens` tokens: every online input waiting (in arrival
order; a forward that carries one carries no batch input, so it ends as soon as it can),
else an anchor and the inputs nearest its length. The anchor is the oldest input of the
group with the fewest tokens embedded so far, so every batch gets forwards in turn and no
input waits behind later ones forever.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Hashable, Set
from typing import Any

from batchwright.engine.embed.packing import Input


class InputQueue:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(1, max_tokens)
        self.online: list[Input] = []
        self._order: dict[int, Input] = {}  # arrival number -> input (insertion ordered)
        self._by_len: list[tuple[int, int]] = []  # (length, arrival number), sorted
        self._arrival: dict[int, int] = {}  # id(input) -> arrival number
        self._count = 0
        self.tokens = 0  # batch tokens waiting
        self.served: Counter[Hashable] = Counter()

    def __bool__(self) -> bool:
        return bool(self.online or self._order)

    def add(self, item: Input, online: bool) -> None:
        if online:
            self.online.append(item)
            return
        n = self._count
        self._count += 1
        self._order[n] = item
        self._arrival[id(item)] = n
        bisect.insort(self._by_len, (len(item.ids), n))
        self.tokens += len(item.ids)

    def drop(self, owners: Set[Any]) -> None:
        """Forget the inputs of cancelled requests (`owners`: their jobs)."""
        self.online = [x for x in self.online if x.owner not in owners]
        gone = [n for n, x in self._order.items() if x.owner in owners]
        for n in gone:
            self._remove(n)

    def _remove(self, n: int) -> Input:
        item = self._order.pop(n)
        del self._arrival[id(item)]
        i = bisect.bisect_left(self._by_len, (len(item.ids), n))
        del self._by_len[i]
        self.tokens -= len(item.ids)
        return item

    def next_pack(self, group_of: Any) -> list[Input]:
        """The inputs of the next forward (removed from the queue)."""
        if self.online:
            return self._take_online()
        if not self._order:
            return []
        anchor = self._anchor(group_of)
        length = len(anchor.ids)
        i = bisect.bisect_left(self._by_len, (length, self._arrival[id(anchor)]))
        lo, hi = i, i + 1  # chosen: _by_len[lo:hi]
        tokens = length
        while True:
            left = self._by_len[lo - 1][0] if lo > 0 else None
            right = self._by_len[hi][0] if hi < len(self._by_len) else None
            if left is None and right is None:
                break
            if right is None or (left is not None and length - left <= right - length):
                if tokens + left > self.max_tokens:  # type: ignore[operator]
                    break
                tokens += left  # type: ignore[operator]
                lo -= 1
            else:
                if tokens + right > self.max_tokens:
                    break
                tokens += right
                hi += 1
        chosen = [self._order[n] for _, n in self._by_len[lo:hi]]
        for _, n in list(self._by_len[lo:hi]):
            self._remove(n)
        for item in chosen:
            self.served[group_of(item)] += len(item.ids)
        if not self._order:
            self.served.clear()  # shares count among the groups waiting together
        return chosen

    def _take_online(self) -> list[Input]:
        taken, tokens = 0, 0
        for item in self.online:
            if taken and tokens + len(item.ids) > self.max_tokens:
                break
            taken += 1
            tokens += len(item.ids)
        chosen, self.online = self.online[:taken], self.online[taken:]
        return chosen

    def _anchor(self, group_of: Any) -> Input:
        firsts: dict[Hashable, Input] = {}
        for item in self._order.values():  # arrival order
            firsts.setdefault(group_of(item), item)
        if len(firsts) == 1:
            return next(iter(firsts.values()))
        return min(firsts.items(), key=lambda gi: self.served[gi[0]])[1]
