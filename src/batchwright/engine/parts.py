"""What the batching loop uses of an engine, as protocols in a low module.

`runtime.Engine` composes the loop (scheduler.py) and is one of these; the loop and its
helpers (intake, slots, padded, graphs, admission) are typed against what they use, so
none of them imports the engine and the package's imports stay acyclic (import-linter
checks it). Tests and benches hand the loop an `Engine`, often with an attribute changed
(`attention_backend`) or a method wrapped (worker/metrics.py): a protocol reads those as
they are when the loop starts, where a snapshot of bound methods would not.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from batchwright.engine.attention import Step
from batchwright.engine.jobs import Job, PromptScores
from batchwright.engine.loader import LoadedModel
from batchwright.engine.lora.run import Lora
from batchwright.engine.paged import PagedCache
from batchwright.engine.types import GenRequest, GenResult
from batchwright.registry import ModelSpec


class GrowingText(Protocol):
    """A row's generated text as tokens arrive (stop.py's IncrementalText, StreamText)."""

    text: str

    def update(self, ids: list[int]) -> str: ...


class Text(Protocol):
    """Token ids as text (streaming.py)."""

    def decode(self, ids: list[int]) -> str: ...

    def text_stream(self) -> GrowingText: ...

    def token_text(self, token: int) -> str: ...

    def token_piece(self, token: int) -> str: ...


class Requests(Protocol):
    """Turning requests into jobs and jobs into results (intake.py)."""

    max_rows: int
    max_batch_tokens: int

    def prepare(self, greq: GenRequest) -> Job | GenResult: ...

    def result(self, job: Job) -> GenResult: ...

    def score_prompt(self, ids: list[int], k: int, adapter: str | None = None) -> PromptScores: ...


class ForwardLast(Protocol):
    """A padded forward of transformers' own attention (padded.py)."""

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor: ...


class Parts(Requests, Text, Protocol):
    """Everything the scheduler uses: the loaded model and its spec, the attention
    backend, the cache factory and the forwards."""

    lm: LoadedModel
    spec: ModelSpec
    attention_backend: str
    lora: Lora | None  # adapters in this model's forward (engine/lora/)

    def new_cache(self) -> PagedCache: ...

    def forward_last(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor: ...

    def forward_step(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None, plan: Step
    ) -> torch.Tensor: ...
