"""The fixed-shape sampler against BatchSampler and against its own contract."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchwright.engine.sampling.params import RowParams
from batchwright.engine.sampling.sample_step import (
    _PER_NAT,
    greedy_step,
    make_tables,
    plain_step,
    sample_step,
)
from batchwright.engine.sampling.sampler import Sampler
from tests.engine.oracle import BatchSampler, update_counts

CPU = torch.device("cpu")
# The CPU step: the native kernel (engine/sampling/native.py), or torch's graphs without it.
PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "graphs"])


def _params(
    temperature: float = 1.0,
    top_p: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    seed: int = 0,
) -> RowParams:
    return RowParams(
        temperature, top_p, presence, frequency, bias or {}, logprobs, random.Random(seed)
    )


def _mix(rows: int, vocab: int) -> list[dict[str, Any]]:
    """Greedy and sampled rows, penalties, bias, logprobs, in every combination."""
    out = []
    for i in range(rows):
        out.append(
            {
                "temperature": [0.0, 0.7, 1.0, 1.3][i % 4],
                "top_p": [1.0, 0.3, 0.05, 1.0][(i // 4) % 4],
                "presence": [0.0, 0.8, -0.5][i % 3],
                "frequency": [0.0, 0.4][i % 2],
                "bias": {(7 * i) % vocab: 4.0, (11 * i + 3) % vocab: -100.0} if i % 5 else None,
                "logprobs": [None, 0, 2, 5][i % 4],
                "seed": 1000 + i,
            }
        )
    return out


def _peaked_logits(rows: int, vocab: int, step: int) -> torch.Tensor:
    # Peaked rows (like a trained model's): the nuclei at top_p < 1 are narrow.
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, vocab, generator=gen) * 4.0


@PATHS
def test_matches_batch_sampler_on_the_same_logits(native: bool) -> None:
    rows, vocab = 24, 5001  # two vocabulary blocks, the second padded
    kinds = _mix(rows, vocab)
    old = BatchSampler([_params(**k) for k in kinds], vocab, CPU)
    new = Sampler(rows, vocab, CPU, native=native)
    new.admit(range(rows), [_params(**k) for k in kinds])
    counts = torch.zeros(rows, vocab)
    for step in range(40):
        logits = _peaked_logits(rows, vocab, step)
        want = old.step(logits.clone(), counts)
        update_counts(counts, want.tokens)
        got = new.unpack(new.step(logits.clone()))
        # Greedy, penalised, biased and seeded rows: the same tokens (sampled rows draw the
        # same uniforms from the same generators, inverse CDF in vocabulary order).
        assert got.tokens == want.tokens, step
        assert torch.allclose(
            torch.tensor(got.chosen_logprobs), torch.tensor(want.chosen_logprobs), atol=1e-5
        )
        assert want.top_ids is not None and want.top_logprobs is not None
        for i, k in enumerate(kinds):
            if k["logprobs"]:
                n = k["logprobs"]
                assert got.top_ids is not None and got.top_logprobs is not None
                assert got.top_ids[i][:n] == want.top_ids[i][:n]
                assert torch.allclose(
                    torch.tensor(got.top_logprobs[i][:n]),
                    torch.tensor(want.top_logprobs[i][:n]),
                    atol=1e-5,
                )


@PATHS
def test_bias_forces_and_bans(native: bool) -> None:
    vocab = 300
    new = Sampler(4, vocab, CPU, native=native)
    new.admit(
        [0, 1, 2, 3],
        [
            _params(0.0, bias={123: 100.0}),
            _params(1.0, bias={123: 100.0}, seed=1),
            _params(0.0),
            _params(0.0, bias={t: -100.0 for t in range(vocab) if t != 42}),
        ],
    )
    logits = _peaked_logits(4, vocab, 0)
    tokens = new.unpack(new.step(logits)).tokens
    assert tokens[:2] == [123, 123]
    assert tokens[2] == int(logits[2].argmax())
    assert tokens[3] == 42


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    ordered = probs.sort(descending=True)
    before = ordered.values.cumsum(0) - ordered.values
    kept = max(1, int((before < top_p).sum()))
    return set(ordered.indices[:kept].tolist())


@PATHS
def test_sampling_stays_inside_the_nucleus(native: bool) -> None:
    vocab, rows = 9001, 64  # four vocabulary blocks
    gen = torch.Generator().manual_seed(3)
    # A narrow nucleus (inside the candidate set) and a wide one (thousands of tokens).
    cases = [(4.0, 0.6), (0.3, 0.8)]
    for scale, top_p in cases:
        logits = torch.randn(vocab, generator=gen) * scale
        probs = torch.softmax(logits, dim=-1)
        inside = _nucleus(probs, top_p)
        # The documented tolerance of a wide nucleus: tokens within one bin of its edge.
        edge = float(probs[list(inside)].min())
        tolerated = {t for t in range(vocab) if probs[t] >= edge * math.exp(-1 / _PER_NAT)}
        seen: Counter[int] = Counter()
        s = Sampler(rows, vocab, CPU, native=native)
        s.admit(range(rows), [_params(1.0, top_p, seed=i) for i in range(rows)])
        full = Sampler(rows, vocab, CPU, native=native)
        full.admit(range(rows), [_params(1.0, 1.0, seed=i) for i in range(rows)])
        outside = 0
        for _ in range(20):
            seen.update(s.unpack(s.step(logits.repeat(rows, 1))).tokens)
            drawn = full.unpack(full.step(logits.repeat(rows, 1))).tokens
            outside += sum(t not in tolerated for t in drawn)
        assert set(seen) <= tolerated, (scale, top_p)
        assert outside > 0  # without top_p, tokens outside it come up
        if len(inside) < 64:
            assert set(seen) == inside  # every nucleus token drawn, nothing outside it
        # Drawn in proportion to their probability inside the nucleus.
        mass = float(probs[list(inside)].sum())
        top = int(probs.argmax())
        share = seen[top] / seen.total()
        assert abs(share - float(probs[top]) / mass) < 0.05 + 3 * math.sqrt(share / seen.total())


@PATHS
def test_seeded_rows_do_not_depend_on_the_batch(native: bool) -> None:
    vocab = 800
    row = {"temperature": 1.1, "top_p": 0.9, "presence": 0.3, "seed": 77}
    alone = Sampler(1, vocab, CPU, native=native)
    alone.admit([0], [_params(**row)])
    crowd = Sampler(8, vocab, CPU, native=native)
    others = [_params(0.8, seed=i) for i in range(7)]
    crowd.admit([0, 1, 2, 4, 5, 6, 7], others)
    want, got = [], []
    # Longer than a uniform ring (refills), with neighbours admitted, released and moved,
    # and admission steps through `rows`.
    for step in range(300):
        logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(step)) * 2
        want.append(alone.unpack(alone.step(logits[3:4].clone())).tokens[0])
        if step == 0:
            crowd.admit([3], [_params(**row)])
            got.append(crowd.unpack(crowd.step(logits[3:4].clone(), rows=[3])).tokens[0])
            continue
        if step == 40:
            crowd.release([1, 5])
        if step == 70:
            crowd.admit([1], [_params(1.5, seed=99)])
        if step == 100:
            crowd.move([3, 6], [6, 3])  # the seeded row now lives in slot 6
        if step == 130:
            crowd.move([6], [2])  # compaction: slot 6 is released, the row is in slot 2
        slot = 2 if step >= 130 else 6 if step >= 100 else 3
        row_logits = logits.clone()
        row_logits[slot] = logits[3]
        got.append(crowd.unpack(crowd.step(row_logits)).tokens[slot])
    assert got == want
    # And the seed matters: another seed draws other tokens from the same logits.
    other = Sampler(1, vocab, CPU, native=native)
    other.admit([0], [_params(**{**row, "seed": 78})])
    drawn = []
    for step in range(20):
        logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(step)) * 2
        drawn.append(other.unpack(other.step(logits[3:4].clone())).tokens[0])
    assert drawn != want[:20]


@PATHS
def test_tiny_temperatures_are_greedy(native: bool) -> None:
    vocab = 500
    s = Sampler(4, vocab, CPU, native=native)
    s.admit(range(4), [_params(t, seed=i) for i, t in enumerate([1e-45, 1e-38, 1e-30, 0.0])])
    for step in range(5):
        logits = _peaked_logits(4, vocab, step)
        out = s.unpack(s.step(logits.clone()))
        assert out.tokens == logits.argmax(dim=-1).tolist()
        assert all(math.isfinite(lp) for lp in out.chosen_logprobs)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops(
    rows: int, kinds: list[dict[str, Any]], *, shortcut: bool = False, native: bool = False
) -> Counter[str]:
    vocab = 2000
    s = Sampler(64, vocab, CPU, shortcut=shortcut, native=native)
    s.admit(range(rows), [_params(**kinds[i % len(kinds)]) for i in range(rows)])
    logits = _peaked_logits(rows, vocab, 0)
    s.step(logits)
    with _OpCounter() as counter:
        s.step(logits)
    return counter.ops


def test_op_count_does_not_depend_on_rows_or_parameters() -> None:
    greedy = [{"temperature": 0.0}]
    mixed = _mix(16, 2000)
    base = _ops(2, greedy)
    assert _ops(48, greedy) == base
    assert _ops(2, mixed) == base
    assert _ops(48, mixed) == base
    views = {"aten.slice.Tensor", "aten.unsqueeze.default", "aten.view.default", "aten.select.int"}
    assert sum(n for op, n in base.items() if op not in views) <= 80
    # The CPU shortcuts for batches without a sampled row: smaller graphs, whatever B.
    plain = _ops(2, greedy, shortcut=True)
    assert _ops(48, greedy, shortcut=True) == plain
    penalised = [{"temperature": 0.0, "presence": 0.5, "logprobs": 2}]
    short = _ops(2, penalised, shortcut=True)
    assert _ops(48, penalised, shortcut=True) == short
    assert sum(plain.values()) < sum(short.values()) < sum(base.values()) / 2
    assert _ops(48, mixed, shortcut=True) == base
    # The native CPU step: one call whatever the rows hold, fewer ops than the plain graph.
    one = _ops(2, greedy, shortcut=True, native=True)
    assert _ops(48, mixed, shortcut=True, native=True) == one
    assert sum(one.values()) < sum(plain.values())


def test_step_compiles_without_graph_breaks() -> None:
    rows, vocab = 6, 700
    compiled = torch.compile(sample_step, fullgraph=True, backend="aot_eager")
    compiled_greedy = torch.compile(greedy_step, fullgraph=True, backend="aot_eager")
    kinds = _mix(rows, vocab)
    a, b = Sampler(rows, vocab, CPU, native=False), Sampler(rows, vocab, CPU, native=False)
    a.admit(range(rows), [_params(**k) for k in kinds])
    b.admit(range(rows), [_params(**k) for k in kinds])
    b._core, b._greedy_core = compiled, compiled_greedy
    b._plain_core = torch.compile(plain_step, fullgraph=True, backend="aot_eager")
    for step in range(3):
        logits = _peaked_logits(rows, vocab, step)
        assert torch.equal(a.step(logits.clone()), b.step(logits.clone()))
        # Batches of greedy rows only take the shortcut graphs (slot 0 is plain greedy,
        # slot 4 has a penalty and bias).
        assert torch.equal(a.step(logits[:1].clone()), b.step(logits[:1].clone()))
        one = logits[4:5]
        assert torch.equal(a.step(one.clone(), rows=[4]), b.step(one.clone(), rows=[4]))
    assert torch.equal(a.counts, b.counts) and torch.equal(a.offset, b.offset)


def test_compiled_step_sweeps_the_vocabulary_at_most_four_times_on_cuda() -> None:
    # bench/sampler_passes.py reads inductor's code for the step: its count is the test's.
    path = Path(__file__).parents[2] / "bench" / "sampler_passes.py"
    spec = importlib.util.spec_from_file_location("sampler_passes", path)
    assert spec is not None and spec.loader is not None
    passes = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = passes  # its dataclass looks its module up
    spec.loader.exec_module(passes)
    rows, vocab = 8, 50021
    sweeps, _, packed = passes.count(rows, vocab)
    kinds = [s.kind for s in sweeps]
    # The per-row state is updated in place, not through a copy of [B, vocab].
    assert "copy" not in kinds
    assert sorted(kinds) == ["max", "scatter", "sum-exp", "sum-exp", "topk", "topk"]
    assert len(sweeps) - sum(s.online for s in sweeps) <= 4
    # And compiled by inductor, the step samples what it samples eagerly.
    eager = sample_step(*passes.inputs(rows, vocab), make_tables(vocab, rows, CPU), 5)
    assert torch.equal(packed[:, 0], eager[:, 0])
    assert torch.allclose(packed, eager, atol=1e-4)


@PATHS
def test_cpu_shortcuts_give_the_full_graphs_result(native: bool) -> None:
    vocab, rows = 900, 6
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.0, "presence": 0.7, "frequency": 0.3, "bias": {5: 3.0}, "logprobs": 3},
    ]
    for kind in kinds:
        fast = Sampler(rows, vocab, CPU, shortcut=True, native=native)
        full = Sampler(rows, vocab, CPU, shortcut=False)
        for s in (fast, full):
            s.admit(range(rows), [_params(**kind, seed=i) for i in range(rows)])
        for step in range(6):
            logits = _peaked_logits(rows, vocab, step)
            a, b = fast.unpack(fast.step(logits.clone())), full.unpack(full.step(logits.clone()))
            assert a.tokens == b.tokens
            assert torch.allclose(torch.tensor(a.chosen_logprobs), torch.tensor(b.chosen_logprobs))
            if kind.get("logprobs"):
                assert a.top_ids == b.top_ids


def test_native_step_gives_the_full_graphs_tokens_and_state() -> None:
    """Every kind of row (greedy, nucleus, penalties, bias, logprobs), constrained rows and
    admission steps through `rows`: the kernel's tokens, logprobs and state are the graph's."""
    rows, vocab = 24, 5001
    kinds = _mix(rows, vocab)
    fast = Sampler(rows, vocab, CPU, native=True)
    full = Sampler(rows, vocab, CPU, shortcut=False)
    assert fast._native is not None
    for s in (fast, full):
        s.admit(range(rows), [_params(**k) for k in kinds])
        # Rows 3 and 10 under a grammar: every third token allowed.
        s.constrain([3, 10])
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[::3] = True
        words = torch.zeros(2, s.host_mask.shape[1] * 32, dtype=torch.int64)
        words[:, :vocab] = allowed.long()
        bits = (words.view(2, -1, 32) << torch.arange(32)).sum(-1)
        s.host_mask[[3, 10]] = bits.to(torch.int64).to(torch.int32)
    for step in range(40):
        logits = _peaked_logits(rows, vocab, step)
        if step % 5 == 4:  # an admission step: some rows, out of order
            picked = [9, 3, 17]
            a = fast.unpack(fast.step(logits[:3].clone(), rows=picked))
            b = full.unpack(full.step(logits[:3].clone(), rows=picked))
        else:
            a = fast.unpack(fast.step(logits.clone()))
            b = full.unpack(full.step(logits.clone()))
        assert a.tokens == b.tokens, step
        constrained = [a.tokens[1]] if step % 5 == 4 else [a.tokens[3], a.tokens[10]]
        assert all(t % 3 == 0 for t in constrained)
        assert a.top_ids == b.top_ids
        for x, y in ((a.chosen_logprobs, b.chosen_logprobs), (a.top_logprobs, b.top_logprobs)):
            d = (torch.tensor(x) - torch.tensor(y)).abs()
            assert d.max() < 1e-5, (step, d.max(), d.argmax())
    assert torch.equal(fast.counts, full.counts) and torch.equal(fast.cursor, full.cursor)
    assert torch.allclose(fast.offset, full.offset)
