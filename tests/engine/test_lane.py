"""The lane (engine/scheduling/lane.py): online requests admitted at the next step ahead
of batch lines, batch rows preempted for them (and the preempted lines' results
unchanged), per-step deltas."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from batchwright.engine.engine import Engine
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.serving.lines import serve
from batchwright.serving.prepare import preparer

EOS_BAN = {"0": -100}  # the demo tokenizer's <|endoftext|> is id 0


class Feed:
    """Online requests handed over at chosen steps (calls of `take`, one per step), and
    what the engine sent back."""

    def __init__(self, at: dict[int, list[GenRequest]] | None = None) -> None:
        self.at = dict(at or {})
        self.calls = 0
        self.deltas: dict[Any, list[tuple[int, list[dict[str, Any]]]]] = defaultdict(list)
        self.lines = self.preempted_rows = 0
        self.started_at: dict[Any, int] = {}
        self.online_rows: list[int] = []

    def take(self) -> list[GenRequest]:
        self.calls += 1
        return self.at.pop(self.calls, [])

    def started(self, key: Any, prompt_tokens: int) -> None:
        self.started_at[key] = self.calls

    def emit(self, key: Any, deltas: list[dict[str, Any]]) -> None:
        assert key in self.started_at
        self.deltas[key].append((self.calls, deltas))

    def rows(self, online: int) -> None:
        self.online_rows.append(online)

    def preempted(self, lines: int, rows: int) -> None:
        self.lines += lines
        self.preempted_rows += rows


def _body(i: int, **kw: Any) -> dict[str, Any]:
    return {"model": "test", "prompt": f"Line {i}: once upon a time", "logit_bias": EOS_BAN, **kw}


def _batch() -> list[GenRequest]:
    """Lines of every kind a preemption must not change."""
    kinds: list[dict[str, Any]] = [
        {"max_tokens": 40, "temperature": 0},
        {"max_tokens": 36, "temperature": 1.0, "top_p": 0.9, "seed": 11, "n": 2},
        {"max_tokens": 30, "temperature": 0.8, "seed": 5, "best_of": 3, "logprobs": 2},
        {"max_tokens": 34, "temperature": 0, "stop": ["e t", "zz"], "logprobs": 1},
        {"max_tokens": 38, "temperature": 1.0, "seed": 3, "presence_penalty": 0.5},
        {"max_tokens": 12, "temperature": 0, "echo": True, "logprobs": 3},
        {"max_tokens": 32, "temperature": 1.2, "seed": 9, "frequency_penalty": 0.4, "n": 3},
    ]
    return [
        GenRequest(("b", i), _body(i, **kinds[i % len(kinds)]), group="batch") for i in range(14)
    ]


def _online(i: int, stream: bool = True, **kw: Any) -> GenRequest:
    body = {"max_tokens": 10, "temperature": 0, **kw}
    return GenRequest(("o", i), _body(100 + i, **body), stream=stream)


def _run(
    engine: Engine, batch: Iterable[GenRequest], feed: Feed | None = None, cancelled: Any = None
) -> dict[Any, GenResult]:
    out: dict[Any, GenResult] = {}
    for r in serve(engine, batch, cancelled=cancelled, online=feed):
        assert r.key not in out, f"{r.key} answered twice"
        out[r.key] = r
    return out


def _same(result: GenResult) -> Any:
    """What must not change, bit for bit: the choices (text, tokens, finish, logprobs) and
    the usage. Steps are batch-invariant (engine/loading/invariance.py): a row's logits do not
    depend on what shares its step."""
    assert result.status_code == 200, result.error
    assert result.completion is not None
    return (
        result.completion["choices"],
        result.completion["usage"],
        result.completion_tokens,
        result.cached_tokens,
    )


def _invariant(engine: Engine) -> None:
    if engine.lm.invariant_rows is None:
        pytest.skip(
            "this CPU's matrix multiply has no batch-invariant row count (logged at load): "
            "the engine then promises equal lines only up to near ties (docs/engine.md)"
        )


@pytest.fixture(scope="module")
def alone(make_engine: Callable[..., Engine]) -> dict[Any, GenResult]:
    return _run(make_engine(max_rows=4), _batch())


@pytest.mark.parametrize("budget", ["rows", "kv"])
def test_preempted_lines_give_the_results_they_would_have_had(
    make_engine: Callable[..., Engine], alone: dict[Any, GenResult], budget: str
) -> None:
    # Rows bind (4 rows), or the KV budget does (8 rows, blocks for about 4).
    spec = {"max_rows": 4} if budget == "rows" else {"max_rows": 8, "kv_tokens": 64 * 5}
    engine = make_engine(**spec)
    _invariant(engine)
    feed = Feed({3: [_online(0)], 9: [_online(1), _online(2)], 25: [_online(3, n=2)]})
    got = _run(engine, _batch(), feed)
    assert feed.lines > 0 and feed.preempted_rows > 0  # batch rows gave way
    batch = {k: v for k, v in got.items() if k[0] == "b"}
    assert batch.keys() == alone.keys()
    for key, result in alone.items():
        assert _same(batch[key]) == _same(result), key
    assert {k for k in got if k[0] == "o"} == {("o", i) for i in range(4)}


def test_preempted_lines_keep_their_usage_with_the_prefix_cache(
    make_engine: Callable[..., Engine],
) -> None:
    """Prompts over a block: a preempted line's own prompt blocks are still cached when it
    comes back; its usage reports what its first prefill found (none here)."""
    story = " ".join(["once upon a time there was a river and a stone"] * 8)
    lines = [
        GenRequest(("b", i), _body(i, prompt=f"{i} {story}", max_tokens=30, temperature=0))
        for i in range(8)
    ]
    engine = make_engine(max_rows=4, prefix_cache=True)
    _invariant(engine)
    alone = _run(engine, lines)
    feed = Feed({3: [_online(0)], 8: [_online(1)], 14: [_online(2)]})
    got = _run(make_engine(max_rows=4, prefix_cache=True), lines, feed)
    assert feed.lines > 0
    for key, result in alone.items():
        assert _same(got[key]) == _same(result), key


def test_a_preempted_line_comes_back_through_the_prefill_it_took_first(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own prompt blocks are still cached when it comes back, but reading them through
    the pages would compute the rest of the prompt in another kernel (other rounding, and
    an argmax near a tie may flip): it uses as many cached blocks as its first prefill."""
    from batchwright.engine.kv.manager import KVManager

    story = " ".join(["once upon a time there was a river and a stone"] * 8)
    lines = [
        GenRequest(("b", i), _body(i, prompt=f"{i} {story}", max_tokens=30, temperature=0))
        for i in range(8)
    ]
    placed: list[tuple[Any, int, int]] = []
    place = KVManager.place

    def recording(self: KVManager, *args: Any, **kwargs: Any) -> Any:
        out = place(self, *args, **kwargs)
        placed.extend((p.unit.job.key, p.unit.prompt_index, p.cached) for p in out)
        return out

    monkeypatch.setattr(KVManager, "place", recording)
    feed = Feed({3: [_online(0)], 8: [_online(1)], 14: [_online(2)]})
    _run(make_engine(max_rows=4, prefix_cache=True), lines, feed)
    first: dict[tuple[Any, int], int] = {}
    again = 0
    for key, prompt, cached in placed:
        if (key, prompt) in first:
            again += 1
            assert cached == first[key, prompt], key
        else:
            first[key, prompt] = cached
    assert again > 0  # lines were preempted and placed again


def test_online_request_starts_at_the_next_step(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=4)
    feed = Feed({2: [_online(0)], 6: [_online(1)], 7: [_online(2)]})
    _run(engine, _batch(), feed)
    for i, step in ((0, 2), (1, 6), (2, 7)):
        first_step, first = feed.deltas[("o", i)][0]
        assert first_step == step  # its first token came out of the step it arrived in
        assert first[0]["text"] or first[0]["token_ids"]


def test_online_requests_never_preempt_each_other(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=2)
    online = [_online(i, max_tokens=8 + i) for i in range(5)]
    feed = Feed({1: online})
    got = _run(engine, [], feed)
    assert feed.lines == 0
    assert set(got) == {r.key for r in online}
    # Two rows: the others waited their turn, in arrival order, and ran unchanged.
    firsts = [feed.deltas[r.key][0][0] for r in online]
    assert firsts == sorted(firsts) and firsts[2] > firsts[1]
    fresh = make_engine(max_rows=2)
    for r in online:
        assert _same(got[r.key]) == _same(_run(fresh, [], Feed({1: [r]}))[r.key])


def test_reserved_rows_stay_free_of_batch_lines(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=4, online_rows=1)
    sched = engine.new_runner()
    batch_rows: list[int] = []

    class Watching(Feed):
        def take(self) -> list[GenRequest]:
            seqs = sched.slots.seqs
            batch_rows.append(sum(1 for q in seqs if q is not None and not q.job.online))
            return super().take()

    feed = Watching({5: [_online(0, max_tokens=10)], 20: [_online(1, max_tokens=10)]})
    keys = {r.key for r in serve(engine, _batch(), online=feed)}
    assert len(keys) == 16
    assert max(batch_rows) == 3  # the batch filled every row but the reserved one
    # The reserved row took each online request at once: no batch line gave way.
    assert feed.lines == 0
    assert [feed.deltas[("o", i)][0][0] for i in (0, 1)] == [5, 20]


def _joined(deltas: list[tuple[int, list[dict[str, Any]]]], index: int) -> dict[str, Any]:
    """A choice rebuilt from its deltas."""
    parts = [d for _, ds in deltas for d in ds if d["index"] == index]
    lp: dict[str, list[Any]] | None = None
    if parts[0]["logprobs"] is not None:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in parts:
            for k in lp:
                lp[k] += p["logprobs"][k]
    finishes = [p["finish_reason"] for p in parts if p["finish_reason"] is not None]
    assert len(finishes) == 1 and parts[-1]["finish_reason"] is not None
    return {
        "finish_reason": finishes[0],
        "index": index,
        "logprobs": lp,
        "text": "".join(p["text"] for p in parts),
        "ids": [t for p in parts for t in p["token_ids"]],  # generated tokens only
        "texts": [p["text"] for p in parts],
    }


STREAMED = [
    {"max_tokens": 24, "temperature": 0},
    {"max_tokens": 24, "temperature": 1.0, "seed": 1, "logprobs": 2, "n": 2},
    {"max_tokens": 20, "temperature": 0, "echo": True, "logprobs": 1},
    {"max_tokens": 0, "echo": True, "logprobs": 0},
    {"max_tokens": 30, "temperature": 1.3, "seed": 4, "logprobs": 0},
    {"prompt": ["One", "Two"], "max_tokens": 6, "temperature": 0.7, "seed": 2, "n": 2},
    {"max_tokens": 16, "temperature": 0, "logit_bias": {}},
]


@pytest.mark.parametrize("body", STREAMED)
def test_deltas_add_up_to_the_completion(
    make_engine: Callable[..., Engine], body: dict[str, Any]
) -> None:
    engine = make_engine(max_rows=8)
    feed = Feed({1: [_online(0, **body)]})
    result = _run(engine, [], feed)[("o", 0)]
    assert result.completion is not None
    deltas = feed.deltas[("o", 0)]
    steps = [s for s, _ in deltas]
    assert len(steps) == len(set(steps))  # one message per step at most
    for choice in result.completion["choices"]:
        got = _joined(deltas, choice["index"])
        assert {k: got[k] for k in choice} == choice
        if body.get("echo"):  # the echo is a delta of its own, the choice's first
            assert got["texts"][0] == _body(100, **body)["prompt"]
        if choice["logprobs"] is not None:
            skip = result.prompt_tokens if body.get("echo") else 0
            generated = choice["logprobs"]["tokens"][skip:]
            assert [engine.token_text(t) for t in got["ids"]] == generated
        sent = ""
        for text in got["texts"]:
            sent += text
            assert choice["text"].startswith(sent)  # nothing sent is ever taken back
    # A non-streamed request gets the same Completion.
    plain = _run(make_engine(max_rows=8), [], Feed({1: [_online(0, stream=False, **body)]}))
    assert _same(plain[("o", 0)]) == _same(result)


def test_stop_sequence_is_never_sent(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_rows=4)
    body = {"max_tokens": 40, "temperature": 0}
    full = _run(engine, [], Feed({1: [_online(0, **body)]}))[("o", 0)].completion
    assert full is not None
    text = full["choices"][0]["text"]
    # A stop sequence that starts a few characters in and spans tokens.
    stop = text[6:10]
    feed = Feed({1: [_online(0, stop=[stop, "never"], **body)]})
    result = _run(engine, [], feed)[("o", 0)].completion
    assert result is not None and result["choices"][0]["text"] == text[: text.find(stop)]
    sent = ""
    for _, ds in feed.deltas[("o", 0)]:
        sent += ds[0]["text"]
        assert stop not in sent
        assert text.startswith(sent)
    assert sent == result["choices"][0]["text"]


def test_cancelled_online_request_leaves_at_the_next_step(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_rows=4)
    feed = Feed({1: [_online(0, max_tokens=100), _online(1, max_tokens=20)]})
    calls = 0

    def cancelled() -> set[Any]:
        nonlocal calls
        calls += 1
        return {("o", 0)} if calls == 4 else set()

    got = _run(engine, [], feed, cancelled)
    assert set(got) == {("o", 1)}
    assert max(s for s, _ in feed.deltas[("o", 0)]) < 4


def test_half_a_character_waits_for_the_rest(make_engine: Callable[..., Engine]) -> None:
    """A character split over byte tokens goes out whole, with its tokens' logprobs; text
    that may still become a stop sequence waits until it cannot."""
    from batchwright.engine.output.streaming import ChoiceStream
    from batchwright.engine.text.token_keys import _byte_level_alphabet

    engine = make_engine(max_rows=4)
    tok = engine.lm.tokenizer
    to_char = {b: c for c, b in _byte_level_alphabet().items()}

    def byte_ids(text: str) -> list[int]:
        return [int(tok.convert_tokens_to_ids(to_char[b])) for b in text.encode()]

    req = GenRequest("k", _body(0, max_tokens=20, logprobs=1, stop=["été!"]))
    request = preparer(engine)(req)
    assert not isinstance(request, GenResult)
    job = engine.start(request)
    seq = job.seqs[0]
    stream = ChoiceStream(engine, job, seq, 0)
    sent: list[str] = []
    tokens: list[list[str]] = []
    ids = byte_ids("añb été?")
    for t in ids:
        assert not seq.push(t, -1.0, [(t, -1.0)])
        d = stream.delta()
        sent.append(d["text"] if d else "")
        tokens.append(d["logprobs"]["tokens"] if d else [])
    # "ñ" is two byte tokens: nothing of it goes until its second byte has come.
    assert sent[:4] == ["a", "", "ñ", "b"]
    assert tokens[1] == [] and tokens[2][0] == "bytes:\\xc3"
    listed = [t for ts in tokens for t in ts]
    assert listed == [engine.token_text(t) for t in ids][: len(listed)]
    # " été" may become the stop sequence "été!" until "?" shows it does not.
    assert "".join(sent[4:-1]) == " " and sent[-1] == "été?"
    assert "".join(sent) == "añb été?"


def test_the_tokenizers_stream_decoder_gives_the_incremental_text(
    make_engine: Callable[..., Engine],
) -> None:
    """Streamed deltas read the text through tokenizers' DecodeStream: at every token the
    same text as IncrementalText over the engine's decode (random tokens: byte fragments,
    invalid sequences, special tokens)."""
    import random

    from batchwright.engine.text.stop import IncrementalText, StreamText

    engine = make_engine(max_rows=4)
    stream = engine.text_stream()
    assert isinstance(stream, StreamText)
    rng = random.Random(0)
    vocab = engine.lm.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        fast, slow = engine.text_stream(), IncrementalText(engine.decode)
        for i in range(1, len(ids) + 1):
            assert fast.update(ids[:i]) == slow.update(ids[:i])
            assert fast.text == slow.text
