"""Variable-length attention and nucleus sampling against independent references."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from batchwright.engine.attention.interface import decode_runs
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.sampling.params import RowParams
from tests.engine.conftest import Direct
from tests.engine.oracle import BatchSampler, _nucleus_floor


def _mixed_bodies(vocab: int, eos: set[int], count: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    bodies = []
    for i in range(count):
        # Lengths from 2 to ~150 tokens: rows in one batch need very different widths.
        length = rng.choice([2, 5, 17, 40, 90, 150]) + i % 3
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = [t for t in prompt if t not in eos] or [3]
        bodies.append({"prompt": prompt, "max_tokens": 1 + (i * 7) % 13, "temperature": 0})
    return bodies


def _brute_force_cost(lengths: list[int], live: list[bool], call_cost: int, max_run: int) -> float:
    """Cheapest split by trying every cut: runs of dead slots may be skipped for free."""
    n = len(lengths)
    best = float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        cost = 0.0
        for a, b in itertools.pairwise(cuts):
            if not any(live[a:b]):
                continue
            if b - a > max_run:
                cost = float("inf")
                break
            cost += (b - a) * max(lengths[a:b]) + call_cost
        best = min(best, cost)
    return best


def test_decode_runs_are_the_cheapest_split() -> None:
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 9)
        lengths = [rng.choice([1, 2, 9, 40, 41, 200]) for _ in range(n)]
        live = [rng.random() < 0.7 for _ in range(n)]
        lengths = [x if alive else 1 for x, alive in zip(lengths, live, strict=True)]
        cost, max_run = rng.choice([0, 10, 120]), rng.choice([2, 4, 16])
        runs = decode_runs(lengths, live, cost, max_run)
        covered = [i for a, b, _ in runs for i in range(a, b)]
        assert covered == sorted(set(covered))  # disjoint, in order
        assert {i for i in range(n) if live[i]} <= set(covered)  # every live row attends
        assert all(w == max(lengths[a:b]) and b - a <= max_run for a, b, w in runs)
        got = sum((b - a) * w + cost for a, b, w in runs)
        assert got == _brute_force_cost(lengths, live, cost, max_run)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "sdpa-runs"])
def test_mixed_lengths_over_several_attention_groups(
    run: Any, make_engine: Any, direct: Any, native: bool
) -> None:
    # 24 rows of very different lengths; 40 requests make rows leave and join, and packed
    # prefills carry several prompts of different lengths. Both decode attention paths.
    eng = make_engine(max_rows=24, max_batch_tokens=400, native_attention=native)
    assert eng.lm.varlen
    if native and paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    assert eng.lm.native_attention == native
    bodies = _mixed_bodies(eng.lm.vocab_size, set(direct.eos), 40)
    results = run.many(bodies, eng)
    for body, res in zip(bodies, results, strict=True):
        want = direct.greedy(body["prompt"], body["max_tokens"])
        if want and want[-1] in direct.eos:
            want = want[:-1]
        assert res.completion["choices"][0]["text"] == eng.decode(want)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "sdpa-runs"])
def test_grouped_query_attention_model(
    run: Any, make_engine: Any, tmp_path: Path, native: bool
) -> None:
    # Fewer key/value heads than query heads: the varlen attention must expand them.
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    eng = make_engine(path=path, max_rows=20, max_batch_tokens=300, native_attention=native)
    ref = Direct(eng)
    bodies = _mixed_bodies(eng.lm.vocab_size, set(ref.eos), 24)
    for body, res in zip(bodies, run.many(bodies, eng), strict=True):
        want = ref.greedy(body["prompt"], body["max_tokens"])
        if want and want[-1] in ref.eos:
            want = want[:-1]
        assert res.completion["choices"][0]["text"] == eng.decode(want)


def test_padded_path_gives_the_same_text(run: Any, make_engine: Any, direct: Any) -> None:
    # A model that cannot take the variable-length attention runs padded batches instead.
    fast = make_engine(max_rows=24, max_batch_tokens=400)
    padded = make_engine(max_rows=24, max_batch_tokens=400)
    padded.lm.varlen = False
    bodies = _mixed_bodies(fast.lm.vocab_size, set(direct.eos), 30)
    a = [r.completion["choices"][0]["text"] for r in run.many(bodies, fast)]
    b = [r.completion["choices"][0]["text"] for r in run.many(bodies, padded)]
    assert a == b


def _row(top_p: float, seed: int) -> RowParams:
    return RowParams(1.0, top_p, 0.0, 0.0, {}, None, random.Random(seed))


def test_top_p_samples_only_inside_the_nucleus() -> None:
    vocab = 50
    logits = torch.linspace(3.0, -3.0, vocab)[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    ]
    probs = torch.softmax(logits, dim=-1)
    # Reference nucleus: most likely tokens first, until the mass reaches top_p.
    order = probs.argsort(descending=True).tolist()
    nucleus, mass = set(), 0.0
    for t in order:
        nucleus.add(t)
        mass += float(probs[t])
        if mass >= 0.6:
            break
    rows = 64
    seen_p: set[int] = set()
    seen_full: set[int] = set()
    for step in range(40):
        batch = logits.repeat(rows, 1)
        nucleus_rows = BatchSampler(
            [_row(0.6, step * rows + i) for i in range(rows)], vocab, batch.device
        )
        seen_p.update(nucleus_rows.step(batch, None).tokens)
        full_rows = BatchSampler(
            [_row(1.0, step * rows + i) for i in range(rows)], vocab, batch.device
        )
        seen_full.update(full_rows.step(batch, None).tokens)
    assert seen_p == nucleus  # every nucleus token drawn, nothing outside it
    assert len(seen_full) > len(nucleus)


def test_nucleus_matches_a_full_sort() -> None:
    # Flat and very peaked rows, and top_p from 0 (greedy) to nearly 1.
    gen = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.05, 0.5, 2.0, 8.0, 30.0]).repeat_interleave(40)
    logits = torch.randn(len(scales), 3000, generator=gen) * scales[:, None]
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([0.0, 0.1, 0.5, 0.9, 0.999]).repeat(40)
    floor = _nucleus_floor(probs, top_p)
    for i in range(len(scales)):
        ordered = probs[i].sort(descending=True).values
        before = ordered.cumsum(0) - ordered
        kept = max(1, int((before < top_p[i]).sum()))
        assert int((probs[i] >= floor[i]).sum()) == kept
