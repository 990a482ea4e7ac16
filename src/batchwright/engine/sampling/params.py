"""Per-row sampling parameters and what a step hands the host (sampler.py samples).

Order per row: raw logits → (logprobs are taken here, from the raw model distribution)
→ presence/frequency penalties → logit_bias → temperature (0 = argmax) → top_p → draw.
Each row draws from its own `random.Random` (seeded from the request's seed), one uniform
per step, and samples by inverse CDF: a row's tokens depend only on its own logits and
its own generator, never on which other rows share the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Temperatures below this are greedy: dividing logits by 1e-38 or 1e-45 overflows float32,
# and below it the distribution is one token anyway unless logits tie within ~1e-4.
TEMPERATURE_EPSILON = 1e-5


@dataclass
class RowParams:
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    logprobs: int | None  # top-k wanted per position, None = no logprobs
    rng: random.Random

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class StepOut:
    tokens: list[int]
    chosen_logprobs: list[float]
    top_ids: list[list[int]] | None  # per row, the max k over rows (callers cut to their k)
    top_logprobs: list[list[float]] | None
