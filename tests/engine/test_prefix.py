"""Shared-prefix reuse: same logits and logprobs as full prefills, and the index's rules."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from batchwright.engine.attention.interface import backends
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.kv.blocks import OutOfBlocks
from batchwright.engine.kv.prefix import Planned, PrefixBlocks
from batchwright.engine.loading.demo import build_demo_model
from tests.engine.conftest import Direct

BS = 16  # a small block size, so short prompts span several blocks


def _bodies(vocab: int, eos: set[int]) -> list[dict[str, Any]]:
    """Lines sharing a 3½-block prefix (some sharing a longer one), in every mode that reads
    prompt logits: greedy with top logprobs, echo scoring, n and best_of with seeds."""
    rng = random.Random(11)

    def toks(k: int) -> list[int]:
        return [t for t in (rng.randrange(3, vocab) for _ in range(k)) if t not in eos] or [3]

    shared = toks(56)
    longer = shared + toks(30)
    bodies: list[dict[str, Any]] = []
    for i in range(14):
        base = longer if i % 3 == 0 else shared
        body: dict[str, Any] = {"prompt": base + toks(1 + (i * 5) % 23), "max_tokens": 3 + i % 6}
        mode = i % 4
        if mode == 0:
            body.update(temperature=0, logprobs=3)
        elif mode == 1:
            body.update(temperature=0, echo=True, logprobs=2)
        elif mode == 2:
            body.update(temperature=0.9, n=2, best_of=3, seed=i, logprobs=1)
        else:
            body.update(temperature=0.7, n=2, seed=100 + i)
        bodies.append(body)
    # A line that is exactly a cached prefix: its last block is recomputed for its logits.
    bodies.append({"prompt": shared[: 3 * BS], "max_tokens": 4, "temperature": 0, "logprobs": 2})
    return bodies


def _compare(
    run: Any, make_engine: Any, path: Path, native: bool, backend: str | None = None
) -> None:
    if native and paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    # Few rows: later lines join as earlier ones leave, so reuse happens both within one
    # admission step and from blocks whose rows have finished.
    spec = {
        "path": path,
        "max_rows": 5,
        "max_batch_tokens": 300,
        "native_attention": native,
        "kv_block_size": BS,
    }
    on = make_engine(prefix_cache=True, **spec)
    off = make_engine(prefix_cache=False, **spec)
    if backend is not None:
        on.attention_backend = off.attention_backend = backend
    assert on.attention_backend == (backend or ("native" if native else "reference"))
    ref = Direct(on)
    bodies = _bodies(on.lm.vocab_size, set(ref.eos))
    with_reuse, without = run.many(bodies, on), run.many(bodies, off)
    cached = [r.completion["usage"]["prompt_tokens_details"]["cached_tokens"] for r in with_reuse]
    assert sum(cached) >= 10 * 3 * BS  # most lines reused at least the shared blocks
    assert cached[-1] == 2 * BS  # a whole-prompt hit still computes the last block
    assert all(
        r.completion["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in without
    )
    for body, a, b in zip(bodies, with_reuse, without, strict=True):
        assert a.status_code == b.status_code == 200
        for ca, cb in zip(a.completion["choices"], b.completion["choices"], strict=True):
            assert ca["text"] == cb["text"]
            if ca["logprobs"] is None:
                continue
            la, lb = ca["logprobs"], cb["logprobs"]
            assert la["tokens"] == lb["tokens"]
            assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
            for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"], strict=True):
                assert (ta is None) == (tb is None)
                if ta is not None:
                    assert ta == pytest.approx(tb, abs=1e-4)
        if body["temperature"] == 0:
            # And against full forward passes of the model: greedy tokens and their logprobs.
            prompt = body["prompt"]
            want = ref.greedy(prompt, body["max_tokens"])
            full = ref.logprobs(prompt + want)
            lp = a.completion["choices"][0]["logprobs"]["token_logprobs"]
            gen = lp[len(prompt) :] if body.get("echo") else lp
            for i, tok in enumerate(want[: len(gen)]):
                assert gen[i] == pytest.approx(float(full[len(prompt) - 1 + i, tok]), abs=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "reference"])
def test_reuse_gives_the_logprobs_of_full_prefills(
    run: Any, make_engine: Any, demo_path: Path, native: bool
) -> None:
    _compare(run, make_engine, demo_path, native)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "reference"])
def test_reuse_with_grouped_query_attention(
    run: Any, make_engine: Any, tmp_path: Path, native: bool
) -> None:
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    _compare(run, make_engine, path, native)


def test_reuse_through_the_varlen_bookkeeping(
    run: Any, make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CUDA backend's arguments with reuse (queries: the new tokens; keys: the whole
    # prompt through its block table), run with varlen_attn's semantics on CPU. The CUDA
    # kernel itself has not run here (no GPU).
    monkeypatch.setattr(backends, "VARLEN_IMPL", backends.varlen_reference)
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    _compare(run, make_engine, path, native=False, backend="varlen")


def _prompt(*blocks: int, tail: int = 1) -> list[int]:
    return [t for b in blocks for t in [b] * BS] + [99] * tail


def test_index_matches_whole_blocks_and_keeps_them_after_release() -> None:
    idx = PrefixBlocks(num_blocks=12, block_size=BS, max_idle=8)
    a = _prompt(1, 2, 3)
    blocks = idx.allocate(4)
    idx.insert(a, blocks)
    assert idx.match(a) == blocks[:3]
    assert idx.match(_prompt(1, 2, 7)) == blocks[:2]  # diverges in the third block
    assert idx.match(_prompt(5)) == []
    assert idx.match(a[: 3 * BS]) == blocks[:2]  # the last token is always computed
    idx.release(blocks)
    assert idx.free == 11  # idle cached blocks count as free
    got = idx.share(idx.match(a))
    assert got == blocks[:3] and all(idx.refs(b) == 1 for b in got)
    assert idx.free == 8
    with pytest.raises(OutOfBlocks):
        idx.allocate(9)


def test_eviction_is_lru_from_the_deepest_block() -> None:
    idx = PrefixBlocks(num_blocks=7, block_size=BS, max_idle=6)
    first = idx.allocate(3)
    idx.insert(_prompt(1, 2, 3), first)
    second = idx.allocate(2)
    idx.insert(_prompt(4, 5), second)
    idx.release(second)
    idx.release(first)  # released last: most recently used
    fresh = idx.allocate(2)  # the one never-used block, then the LRU idle one
    assert idx.match(_prompt(4, 5)) == second[:1]  # a row's deepest block goes first
    fresh += idx.allocate(1)
    assert idx.match(_prompt(4, 5)) == []
    assert idx.match(_prompt(1, 2, 3)) == first
    assert sorted(fresh) == sorted([6, *second])
    idx.release(fresh)
    # An idle budget of one block: releasing more evicts down to it, deepest first.
    small = PrefixBlocks(num_blocks=8, block_size=BS, max_idle=1)
    blocks = small.allocate(3)
    small.insert(_prompt(1, 2, 3), blocks)
    small.release(blocks)
    assert small.match(_prompt(1, 2, 3)) == blocks[:1]
    assert small.cached == 1 and small.free == 7


def test_admission_counts_prefixes_coming_in_the_same_step() -> None:
    idx = PrefixBlocks(num_blocks=20, block_size=BS, max_idle=8)
    held = idx.allocate(2)
    idx.insert(_prompt(1, 2, tail=0), held)  # a running row holds [1, 2]
    idle = idx.allocate(1)
    idx.insert(_prompt(6, tail=0), idle)
    idx.release(idle)  # [6] is cached, nobody uses it
    plan = Planned(idx, lambda u: idx.blocks_for(len(u.prompt) + 4))
    a = _Unit(_prompt(1, 2, 3, tail=5))
    assert plan.tokens(a) == BS + 5 and plan.blocks(a) == 2  # [1, 2] is in use
    # Shares three blocks with a prompt admitted earlier in the same step.
    b = _Unit(_prompt(1, 2, 3, tail=9))
    assert plan.tokens(b) == 9 and plan.blocks(b) == 1
    c = _Unit(_prompt(6, 7, tail=2))
    assert plan.tokens(c) == BS + 2 and plan.blocks(c) == 3 - 1 + 1  # the idle block moves


class _Job:
    requeued = False  # a line admitted for the first time (not back from preemption)
    adapter_key = None  # the base model's blocks (no LoRA adapter)


class _Unit:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.prompt_index = 0
        self.job = _Job()
