"""Incremental stop matching gives exactly what matching the whole decoded text gives."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from batchwright.engine.loading.demo import _corpus_lines, build_tokenizer
from batchwright.engine.text.stop import StopChecker

Decode = Callable[[list[int]], str]


def _whole_text(stops: list[str], decode: Decode, ids: list[int]) -> tuple[int, int] | None:
    """The reference: decode every prefix of `ids` whole; (tokens, index) of the first hit."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return n, min(hits)
    return None


def _incremental(stops: list[str], decode: Decode, ids: list[int]) -> tuple[int, int] | None:
    checker = StopChecker(stops, decode)
    for n in range(1, len(ids) + 1):
        at = checker.check(ids[:n])
        assert checker.text == decode(ids[:n]).rstrip("\ufffd")
        if at is not None:
            return n, at
    return None


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Metaspace BPE: like SentencePiece, its decoder drops the first token's space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator([*_corpus_lines(), "é ü € ☃ 😀"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")  # type: ignore[no-untyped-call]


def _decoder(tok: PreTrainedTokenizerFast) -> Decode:
    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_same_result_as_matching_the_whole_text(kind: str) -> None:
    tok = build_tokenizer() if kind == "byte_level" else _sentencepiece_like()
    decode = _decoder(tok)
    vocab = [t for t in range(len(tok)) if t not in tok.all_special_ids]
    rng = random.Random(5)
    lines = _corpus_lines()
    if kind == "sentencepiece_like":
        # Per-token decoding loses spaces here: what the incremental scheme must survive.
        ids = tok("the quick brown fox").input_ids
        assert "".join(decode([t]) for t in ids) != decode(ids)
    found = 0
    for trial in range(300):
        if trial % 2:
            # Random tokens: byte fragments, incomplete and invalid UTF-8 included.
            ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 40))]
        else:
            ids = tok(rng.choice(lines) + " é€😀 " + rng.choice(lines)).input_ids[:60]
        text = decode(ids).rstrip("\ufffd")
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if text and rng.random() < 0.8:
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randrange(1, 8)])
            else:
                stops.append(rng.choice(["zzq", "\n\n", "é€", " the"]))
        stops = [s for s in stops if s and "\ufffd" not in s] or ["zzq"]
        want = _whole_text(stops, decode, ids)
        assert _incremental(stops, decode, ids) == want, (ids, stops)
        found += want is not None
    assert found > 150  # most cases end on a stop, many spanning token boundaries


def test_each_step_decodes_only_the_new_tokens() -> None:
    tok = build_tokenizer()
    decoded = 0
    base = _decoder(tok)

    def decode(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return base(ids)

    ids = tok(" ".join(_corpus_lines()[:60])).input_ids
    assert len(ids) > 1000
    checker = StopChecker(["never there"], decode)
    for n in range(1, len(ids) + 1):
        assert checker.check(ids[:n]) is None
    # Whole-text matching would decode about len(ids)**2 / 2 tokens.
    assert decoded < 6 * len(ids)
    assert checker.text == base(ids)
