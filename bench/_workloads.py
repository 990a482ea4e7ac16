"""The CPU engine benches' request sets, torch-free so a runner of any revision can take
them as JSON (bench/ab.py) and engine_bench.py builds the same ones."""

from __future__ import annotations

import random
from typing import Any


def make_requests(n: int, vocab: int, eos: int, rng: random.Random, *, scale: float) -> list[Any]:
    """Heterogeneous bodies: prompt lengths 8-256, max_tokens 8-128, mixed parameters."""
    out = []
    for i in range(n):
        plen = rng.randint(8, int(256 * scale))
        prompt = [rng.randrange(1, vocab) for _ in range(plen)]
        body: dict[str, Any] = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": rng.randint(8, int(128 * scale)),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": i,
            # EOS banned so every system generates exactly max_tokens (comparable work).
            "logit_bias": {str(eos): -100},
        }
        if i % 4 == 1:
            body["presence_penalty"] = 0.5
            body["frequency_penalty"] = 0.3
        if i % 5 == 2:
            body["stop"] = ["\n\n", "zzz"]
        if i % 7 == 3:
            body["logprobs"] = 2
        out.append(body)
    return out


def homogeneous(bodies: list[dict[str, Any]], eos: int, vocab: int) -> list[dict[str, Any]]:
    """The same token counts as `bodies` in one shape: every prompt of the mean length and
    every row generating the mean max_tokens, greedy with nothing else set. The prompts are
    distinct (random tokens, like the heterogeneous ones): one prompt repeated would be
    prefilled once by the prefix cache, and E3 would measure prefix reuse instead of the
    cost of mixing parameters."""
    plen = round(sum(len(b["prompt"]) for b in bodies) / len(bodies))
    mt = round(sum(b["max_tokens"] for b in bodies) / len(bodies))
    rng = random.Random(1_000_003)
    return [
        {
            "model": "bench",
            "prompt": [rng.randrange(1, vocab) for _ in range(plen)],
            "max_tokens": mt,
            "temperature": 0.0,
            "logit_bias": {str(eos): -100},
        }
        for _ in bodies
    ]


def same_lengths(bodies: list[dict[str, Any]], eos: int, vocab: int) -> list[dict[str, Any]]:
    """`bodies`' own prompt lengths and max_tokens, every request greedy with nothing else
    set (distinct random prompts): against `bodies` it isolates what mixing parameters
    costs, against `homogeneous` what the ragged lengths cost (docs/engine.md, E3)."""
    rng = random.Random(1_000_033)
    return [
        {
            "model": "bench",
            "prompt": [rng.randrange(1, vocab) for _ in b["prompt"]],
            "max_tokens": b["max_tokens"],
            "temperature": 0.0,
            "logit_bias": {str(eos): -100},
        }
        for b in bodies
    ]
