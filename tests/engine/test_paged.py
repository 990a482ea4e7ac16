"""The paged KV cache: blocks, the attention backends that read it, budgets and cancels."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from batchwright.engine.attention import backends, native
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.kv.blocks import SCRATCH, BlockAllocator, OutOfBlocks
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.requests.types import GenRequest
from batchwright.engine.runner.slots import bucket
from batchwright.serving.lines import serve
from tests.engine.conftest import Direct

# The native builds this CPU runs (torch's capability names the best of them).
_RUNNABLE = {
    "avx512": {"avx512", "avx2"},
    "avx2": {"avx2"},
}.get(torch.backends.cpu.get_cpu_capability().lower(), set())


def test_blocks_are_reference_counted() -> None:
    alloc = BlockAllocator(6, 4)
    a = alloc.allocate(3)
    assert SCRATCH not in a and len(set(a)) == 3 and alloc.free == 2
    alloc.share(a[:2])  # a second row on the same prompt blocks
    alloc.release(a)
    assert alloc.free == 3  # the shared two are still held
    assert [alloc.refs(b) for b in a] == [1, 1, 0]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(4)
    alloc.release(a[:2])
    assert alloc.free == 5 and alloc.blocks_for(9) == 3
    with pytest.raises(ValueError, match="released"):
        alloc.release(a[:1])


def _pages(lens: list[int], bs: int, heads: int, dim: int, gen: torch.Generator) -> Any:
    """Pools with each row's tokens scattered over shuffled blocks, and the dense copy."""
    need = sum(-(-n // bs) for n in lens) + 1
    order = list(range(1, need))
    random.Random(0).shuffle(order)
    kpool = torch.randn(need, bs, heads, dim, generator=gen)
    vpool = torch.randn(need, bs, heads, dim, generator=gen)
    width = max(-(-n // bs) for n in lens)
    table = torch.zeros(len(lens), width + 2, dtype=torch.int32)
    for r, n in enumerate(lens):
        for i in range(-(-n // bs)):
            table[r, i] = order.pop()
    return kpool, vpool, table


def test_paged_backends_match_sdpa_per_row() -> None:
    # Grouped-query heads, dead rows (length 0), lengths across block boundaries; blocks
    # in shuffled order. The native kernel and the page-gather reference against SDPA on
    # each row's own tokens.
    gen = torch.Generator().manual_seed(5)
    lens = [1, 16, 0, 17, 40, 2, 0, 33, 8]
    bs, q_heads, kv_heads, dim = 8, 6, 2, 32
    kpool, vpool, table = _pages(lens, bs, kv_heads, dim, gen)
    q = torch.randn(len(lens), q_heads, dim, generator=gen)
    want = _sdpa_per_row(q, kpool, vpool, table, lens, 0.3)
    runs = [(0, 2, 16), (3, 6, 40), (7, 9, 33)]
    got = backends.reference(q, kpool, vpool, table, runs, lens, 0.3, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kernel = paged_attention_kernel()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    got = kernel(q, kpool, vpool, table, torch.tensor(lens), 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("bs", "q_heads", "kv_heads", "dim", "spread"),
    [
        (64, 4, 4, 64, 1.0),  # the CPU engine's blocks and a typical head shape
        (64, 14, 2, 64, 1.0),  # grouped-query heads, 7 per kv head
        (64, 4, 1, 64, 8.0),  # one kv head; peaked softmax (weights far below 1e-38)
        (8, 4, 2, 80, 1.0),  # dim 80: the vector loops in a 64 and a 16 part
        (5, 4, 2, 16, 1.0),  # blocks not a multiple of 8 tokens
        (8, 4, 2, 32, 1.0),  # rows on shared blocks in pairs, two AVX-512 registers a head
        (16, 2, 1, 16, 8.0),  # ... one register a head
        (16, 6, 2, 20, 1.0),  # dim not a multiple of 8: the plain loops
        (7, 3, 1, 36, 4.0),
    ],
)
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_native_paged_kernel_shapes(
    bs: int, q_heads: int, kv_heads: int, dim: int, spread: float, isa: str
) -> None:
    # The native kernel's vector and plain paths against SDPA on each row's own tokens:
    # lengths at and around block and 8-token boundaries, dead rows, and rows sharing
    # their first blocks (a shared prompt prefix, read by consecutive rows). Every build
    # this CPU runs: the engine takes the best, other machines the others.
    if paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    if isa not in _RUNNABLE:
        pytest.skip(f"this CPU does not run {isa}")
    kernel = native.kernel_for(isa)
    gen = torch.Generator().manual_seed(11)
    lens = [1, 7, 8, 9, bs, bs + 1, 0, 3 * bs + 5, 3 * bs + 2, 2 * bs, 0, 4 * bs - 1, 31]
    kpool, vpool, table = _pages(lens, bs, kv_heads, dim, gen)
    table[8, :3] = table[7, :3]  # rows 7, 8 and 9 share their first blocks (a tile of 3)
    table[9, :2] = table[7, :2]
    table[5, :1] = table[4, :1]  # rows 4 and 5 their first (a pair: row 6 is dead)
    q = torch.randn(len(lens), q_heads, dim, generator=gen) * spread
    want = _sdpa_per_row(q, kpool, vpool, table, lens, dim**-0.5)
    got = kernel(q, kpool, vpool, table, torch.tensor(lens), dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 32), (4, 1, 16), (4, 2, 48)]
)
def test_tiles_give_a_row_the_bits_it_gets_alone(q_heads: int, kv_heads: int, dim: int) -> None:
    # A prompt's tokens through the paged kernel as the batch-invariant steps send them:
    # one row per token on the prompt's blocks, neighbours read in AVX-512 tiles of two and
    # three. Each row must get exactly the bits it gets read alone (a line computed again
    # after preemption, its tokens in other tiles, gives the same text).
    if paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    if "avx512" not in _RUNNABLE:
        pytest.skip("tiles are AVX-512 only")
    kernel = native.kernel_for("avx512")
    gen = torch.Generator().manual_seed(3)
    bs = 16
    kpool = torch.randn(40, bs, kv_heads, dim, generator=gen)
    vpool = torch.randn(40, bs, kv_heads, dim, generator=gen)
    lens = [*range(1, 61), 33, 50, 17]  # a prompt's 60 tokens, then rows of another
    table = torch.zeros(len(lens), 8, dtype=torch.int32)
    table[:60] = torch.tensor([3, 7, 1, 9, 11, 2, 5, 4], dtype=torch.int32)
    table[60:] = torch.tensor([3, 7, 12, 13, 14, 15, 16, 17], dtype=torch.int32)
    q = torch.randn(len(lens), q_heads, dim, generator=gen)
    together = kernel(q, kpool, vpool, table, torch.tensor(lens), dim**-0.5, tiles=True)
    alone = kernel(q, kpool, vpool, table, torch.tensor(lens), dim**-0.5, tiles=False)
    assert torch.equal(together, alone)


def _sdpa_per_row(
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    table: torch.Tensor,
    lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Decode attention by SDPA on each row's own tokens (zeros for dead rows)."""
    want = torch.zeros_like(q)
    for r, n in enumerate(lens):
        if n:
            k = backends.gather(kpool, table[r : r + 1], n)
            v = backends.gather(vpool, table[r : r + 1], n)
            want[r] = F.scaled_dot_product_attention(
                q[r, :, None][None], k, v, scale=scale, enable_gqa=True
            )[0, :, 0]
    return want


def _bodies(vocab: int, eos: set[int], count: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [t for t in (rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 40, 70])))]
        prompt = [t for t in prompt if t not in eos] or [3]
        out.append({"prompt": prompt, "max_tokens": 2 + (i * 5) % 11, "temperature": 0})
    return out


def _check_greedy(run: Any, eng: Any, ref: Direct, bodies: list[dict[str, Any]]) -> None:
    for body, res in zip(bodies, run.many(bodies, eng), strict=True):
        want = ref.greedy(body["prompt"], body["max_tokens"])
        if want and want[-1] in ref.eos:
            want = want[:-1]
        assert res.completion["choices"][0]["text"] == eng.decode(want)


def test_varlen_backend_bookkeeping(
    run: Any, make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CUDA backend's arguments (query offsets, lengths, block tables of decode rows
    # and prompts in one call) built by the scheduler, with varlen_attn's semantics run
    # on CPU: the text must be the full forward passes'. Grouped-query model.
    monkeypatch.setattr(backends, "VARLEN_IMPL", backends.varlen_reference)
    path = build_demo_model(tmp_path / "gqa", heads=4, kv_heads=2, seed=3)
    eng = make_engine(path=path, max_rows=12, max_batch_tokens=200, native_attention=False)
    eng.attention_backend = "varlen"
    ref = Direct(eng)
    _check_greedy(run, eng, ref, _bodies(eng.lm.vocab_size, set(ref.eos), 30))


def test_kv_budget_admits_rows_as_blocks_free(run: Any, make_engine: Any, direct: Any) -> None:
    # A cache of 160 tokens (10 blocks of 16) holds two or three of these rows at a time:
    # the rest wait for blocks rather than rows, and every text is still exact.
    eng = make_engine(max_rows=8, kv_tokens=160)
    bodies = _bodies(eng.lm.vocab_size, set(direct.eos), 12, seed=3)
    _check_greedy(run, eng, direct, bodies)
    # One that can never fit gets a 400 naming max_tokens; the others still run.
    big = {"prompt": "hello", "max_tokens": 300, "temperature": 0}
    results = run.many([big, bodies[0]], eng)
    assert results[0].status_code == 400 and results[0].error["param"] == "max_tokens"
    assert results[1].status_code == 200


def test_candidates_share_prompt_blocks(run: Any, make_engine: Any, direct: Any) -> None:
    # 4 greedy candidates of a 21-token prompt: one full block shared, the partial block
    # copied per candidate. All four must continue exactly like the direct greedy text.
    eng = make_engine(max_rows=8)
    prompt = direct.ids("The quick brown fox jumps over the lazy dog. A batch of requests")
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "n": 4}
    want = direct.greedy(prompt, 9)
    if want and want[-1] in direct.eos:
        want = want[:-1]
    texts = [c["text"] for c in run.ok(body, eng)["choices"]]
    assert texts == [eng.decode(want)] * 4


def test_blocks_are_all_released(make_engine: Any, direct: Any) -> None:
    # Finished rows give their blocks back at once; after the run nothing is held, also
    # when the consumer stops reading early.
    eng = make_engine(max_rows=6)
    bodies = _bodies(eng.lm.vocab_size, set(direct.eos), 10)
    reqs = [GenRequest(i, {"model": "t", **b, "n": 1 + i % 3}) for i, b in enumerate(bodies)]
    sched = eng.new_runner()
    alloc = sched.cache.alloc
    assert len(list(serve(eng, reqs))) == len(reqs)
    assert alloc.used == 0
    sched = eng.new_runner()
    gen = serve(eng, reqs)
    next(gen)
    assert sched.cache.alloc.used > 0
    gen.close()
    assert sched.cache.alloc.used == 0


def test_cancelled_rows_leave_without_a_result(make_engine: Any, direct: Any) -> None:
    # Keys returned by `cancelled` are dropped at once, running or still waiting, with
    # no result; everything else completes as without the cancel.
    eng = make_engine(max_rows=4)
    bodies = _bodies(eng.lm.vocab_size, set(direct.eos), 12)
    for i, b in enumerate(bodies):
        b["max_tokens"] = 3 + 2 * i
    reqs = [GenRequest(i, {"model": "t", **b}) for i, b in enumerate(bodies)]
    plain = {r.key: r for r in serve(eng, reqs)}
    cancel: set[int] = set()
    calls = 0

    def cancelled() -> set[int]:
        nonlocal calls
        calls += 1
        return cancel

    sched = eng.new_runner()
    got = {}
    for res in serve(eng, reqs, cancelled):
        got[res.key] = res
        if len(got) == 1:
            # One request surely running, and the last ones surely still waiting.
            running = {s.job.key for s in sched.slots.seqs if s is not None}
            cancel |= {min(running), 10, 11}
    assert not cancel & set(got)
    assert set(got) == set(plain) - cancel
    for key, res in got.items():
        assert res.completion["choices"][0]["text"] == plain[key].completion["choices"][0]["text"]
    assert calls > 0 and sched.cache.alloc.used == 0


def test_row_buckets() -> None:
    assert [bucket(n, 256, False) for n in (0, 1, 7, 200)] == [0, 1, 7, 200]
    assert [bucket(n, 256, True) for n in (1, 8, 9, 65, 200, 256)] == [8, 8, 16, 128, 256, 256]
    assert bucket(70, 100, True) == 100


def test_host_one_step_behind_gives_the_same_results(make_engine: Any, direct: Any) -> None:
    # On CUDA the host records step t's tokens while step t + 1 runs; rows that finished
    # run one step more, and that token must vanish. Forced on CPU: seeded sampling, stop
    # strings, n, penalties, logprobs and cancels all come out as without the lag.
    eng = make_engine(max_rows=5)
    rng = random.Random(11)
    bodies = []
    for i, b in enumerate(_bodies(eng.lm.vocab_size, set(direct.eos), 14, seed=5)):
        b.update(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=3 + i % 9)
        if i % 3 == 0:
            b.update(stop=["e", "th"], logprobs=2, n=2, best_of=3, frequency_penalty=0.5)
        bodies.append(b)
    reqs = [GenRequest(i, {"model": "t", **b}) for i, b in enumerate(bodies)]

    def results(lag: bool) -> dict[int, Any]:
        sched = eng.new_runner()
        sched.lag = lag
        out = {r.key: r.completion for r in serve(eng, reqs, lambda: {4})}
        assert sched.cache.alloc.used == 0
        return out

    def tokens(c: dict[str, Any]) -> Any:
        return c["text"], c["finish_reason"], c["logprobs"] and c["logprobs"]["tokens"]

    def logprobs(c: dict[str, Any]) -> list[float]:
        return c["logprobs"]["token_logprobs"] if c["logprobs"] else []

    plain, behind = results(False), results(True)
    assert 4 not in plain and set(plain) == set(behind)
    for key, completion in plain.items():
        assert behind[key]["usage"] == completion["usage"]
        for x, y in zip(behind[key]["choices"], completion["choices"], strict=True):
            assert tokens(x) == tokens(y)
            # Neighbours differ by a step, and batched matrix products round differently.
            assert logprobs(x) == pytest.approx(logprobs(y), rel=1e-5, abs=1e-5)
