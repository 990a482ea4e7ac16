"""What the scheduler reads of the rows running (the model runner holds them), and the one
thing it does to them: ending a job's rows when it takes them back (preemption)."""

from __future__ import annotations

from typing import Protocol

from batchwright.engine.kv.manager import KVManager
from batchwright.engine.lora.run import LoraRun
from batchwright.engine.requests.jobs import Seq


class Rows(Protocol):
    max_rows: int
    kv: KVManager
    lora: LoraRun | None  # the rows' LoRA adapters: admission takes a slot for each

    @property
    def seqs(self) -> list[Seq | None]:
        """The candidate in each row (slot), None where the row is free."""
        ...

    @property
    def free(self) -> int:
        """Rows free now."""
        ...

    @property
    def live(self) -> int:
        """Rows running now."""
        ...

    def compactable(self) -> bool:
        """Whether moving rows into holes would let steps run fewer rows."""
        ...

    def end(self, rows: list[int]) -> None:
        """These rows leave now: their blocks are released, their sampler state reset."""
        ...
