"""top_logprobs keys: byte fragments are written `bytes:\\xNN` and never collapse."""

from __future__ import annotations

from typing import Any

from batchwright.engine.output.result import top_dict


def _fragments(engine: Any) -> list[int]:
    """Tokens of the demo (byte-level) tokenizer that are lone bytes of UTF-8 characters."""
    return [t for t in range(engine.lm.vocab_size) if "\ufffd" in engine.decode([t])]


def test_byte_fragments_have_distinct_keys(engine: Any) -> None:
    frags = _fragments(engine)
    assert len(frags) > 100
    keys = [engine.token_text(t) for t in frags]
    assert len(set(keys)) == len(frags)
    for t, key in zip(frags, keys, strict=True):
        assert key.startswith("bytes:\\x")
        raw = bytes.fromhex(key.removeprefix("bytes:").replace("\\x", ""))
        assert raw.decode("utf-8", errors="replace") == engine.decode([t])
    assert engine.token_text(engine.lm.tokenizer("hello").input_ids[0]) != ""
    assert not any(engine.token_text(t).startswith("bytes:") for t in range(3, 60))
    # Two fragments among the top tokens: two entries, the chosen one with its own logprob.
    a, b = frags[:2]
    top = top_dict([(a, -1.0), (b, -2.0)], 2, b, -2.0, engine.token_text)
    assert top == {engine.token_text(a): -1.0, engine.token_text(b): -2.0}


def test_chosen_fragment_is_keyed_in_top_logprobs(run: Any, engine: Any) -> None:
    e_acute = "é".encode()  # two byte-level tokens, each a fragment on its own
    ids = [engine.lm.tokenizer.convert_tokens_to_ids(c) for c in ("Ã", "©")]
    assert engine.decode(ids) == "é" and ids[0] != ids[1]
    keys = [f"bytes:\\x{e_acute[0]:02x}", f"bytes:\\x{e_acute[1]:02x}"]
    out = run.ok(
        {
            "prompt": "The weather",
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 5,
            "logit_bias": {str(ids[0]): 100},
        }
    )["choices"][0]
    lp = out["logprobs"]
    assert lp["tokens"] == [keys[0]] * 3
    for tok, chosen, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert top[tok] == chosen  # the chosen token's own entry, whatever else is there
    # Echoed prompt tokens are keyed the same way; the text is the decoded bytes.
    prompt = [*engine.lm.tokenizer("Caf").input_ids, *ids]
    echo = run.ok({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})["choices"][0]
    assert echo["text"] == "Café"
    assert echo["logprobs"]["tokens"][-2:] == keys
    assert echo["logprobs"]["text_offset"][-2:] == [3, 4]
