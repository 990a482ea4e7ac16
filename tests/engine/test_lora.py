"""LoRA adapters in the engine against PEFT: one forward for rows of several adapters and
the base, PEFT's `adapter_names` mixed batch as the oracle (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchwright.engine.engine import Engine
from batchwright.engine.lora.kernels import Dense, Grouped, dense_state
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.serving.lines import serve
from tests.lora_models import SPECS, PeftOracle, build_adapter, build_adapters

TOL = 1e-4


@pytest.fixture(scope="module")
def adapters(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_adapters(demo_path, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def oracle(demo_path: Path, adapters: dict[str, Path]) -> PeftOracle:
    return PeftOracle(demo_path, adapters)


def lora_engine(
    make_engine: Callable[..., Engine], adapters: dict[str, Path], **spec: Any
) -> Engine:
    engine = make_engine(**spec)
    assert engine.lora is not None
    for name, path in adapters.items():
        engine.lora.store.register(name, path)
    return engine


def run(engine: Engine, lines: list[tuple[str | None, dict[str, Any]]]) -> list[GenResult]:
    reqs = [
        GenRequest(i, {"model": name or "test", **body}, adapter=name)
        for i, (name, body) in enumerate(lines)
    ]
    results = {r.key: r for r in serve(engine, reqs)}
    return [results[i] for i in range(len(reqs))]


PROMPTS = [
    "Once upon a time there was",
    "The quick brown fox",
    "Questions: What is the capital",
    "Numbers like 0 1 2 3",
]


@pytest.mark.parametrize("kernel", ["grouped", "grouped-each", "dense"])
def test_one_forward_of_mixed_adapters_gives_peft_logits(
    make_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    oracle: PeftOracle,
    kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of three adapters (different ranks and target modules, packed q/k/v and
    gate/up among them) and the base in one forward: each row's logits are PEFT's for its
    adapter within 1e-4, with groups padded into batched matmuls, run one by one, or
    every slot masked (dense)."""
    monkeypatch.setattr(Grouped, "PAD_WASTE", 0.0 if kernel == "grouped-each" else 1e9)
    engine = lora_engine(make_engine, adapters, max_loras=4)
    lora = engine.lora
    assert lora is not None
    names: list[str | None] = ["attn-r8", None, "mlp-r4", "all-r16", "attn-r8", None]
    rows = [[(7 * i + 3 * j) % 900 + 1 for j in range(12)] for i in range(len(names))]
    lora.slots.dense = kernel == "dense"  # the layout the kernel reads (set before loading)
    slot = {}
    for name in adapters:
        weights = lora.store.request(name).result()
        got = lora.slots.acquire(weights, set())
        assert got is not None
        slot[name] = got
    length = len(rows[0])
    if kernel.startswith("grouped"):
        groups: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                groups.setdefault(slot[name], []).extend(range(i * length, (i + 1) * length))
        rank = max(lora.slots.ranks[s] for s in groups)
        lora.state.kernel = Grouped(sorted(groups.items()), rank, lora.device)
    else:
        dense_state(lora.state, lora.slots.max_loras, 256, lora.device)
        index = [0 if n is None else slot[n] + 1 for n in names for _ in range(length)]
        assert lora.state.index is not None
        lora.state.index[: len(index)] = torch.tensor(index)
        lora.state.kernel = Dense(lora.state)
    try:
        with torch.inference_mode():
            ours = engine.lm.model(input_ids=torch.tensor(rows), use_cache=False).logits
    finally:
        lora.state.kernel = None
    want = oracle.logits(rows, names)
    assert (ours - want).abs().max().item() < TOL
    # Each adapter changes the base's logits by far more than the tolerance.
    base = oracle.logits(rows, [None] * len(rows))
    for i, name in enumerate(names):
        moved = (want[i] - base[i]).abs().max().item()
        assert (moved > 0.1) == (name is not None), (name, moved)


def test_mixed_batch_greedy_and_logprobs_equal_peft(
    make_engine: Callable[..., Engine], adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    """Lines of three adapters and the base in one run (their rows share every decode
    step): greedy text is PEFT's for each line's adapter (8/8) and each token's logprob
    is within 1e-4 of PEFT's."""
    engine = lora_engine(make_engine, adapters, max_loras=4)
    names: list[str | None] = ["attn-r8", "mlp-r4", "all-r16", None] * 2
    lines = [
        (name, {"prompt": PROMPTS[i // 2], "max_tokens": 8, "temperature": 0, "logprobs": 1})
        for i, name in enumerate(names)
    ]
    results = run(engine, lines)
    eos = set(engine.lm.eos_ids)
    tok = engine.lm.tokenizer
    same = 0
    texts = set()
    for (name, body), r in zip(lines, results, strict=True):
        assert r.status_code == 200, r.error
        assert r.completion is not None
        assert r.completion["model"] == (name or "test")
        ids = list(tok(body["prompt"]).input_ids)
        want = oracle.greedy(ids, 8, name, eos)
        choice = r.completion["choices"][0]
        got_text = choice["text"]
        texts.add((body["prompt"], got_text))
        same += got_text == engine.decode(want)
        lps = oracle.logprobs(ids + want, name)
        for j, lp in enumerate(choice["logprobs"]["token_logprobs"]):
            assert abs(lp - lps[len(ids) + j - 1, want[j]].item()) < TOL
    assert same == len(lines)
    # The adapters really differ: the same prompt gives other text under each of them.
    assert len({t for p, t in texts if p == PROMPTS[0]}) > 1


def test_more_adapters_than_slots_wait_and_never_fail(
    make_engine: Callable[..., Engine], adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    """Two slots, three adapters, lines interleaved: rows whose adapter has no slot wait
    for one (the least recently used adapter goes), every line succeeds with PEFT's text."""
    engine = lora_engine(make_engine, adapters, max_loras=2, max_rows=4)
    names = list(adapters) * 3
    lines = [
        (name, {"prompt": PROMPTS[i % 4], "max_tokens": 6, "temperature": 0})
        for i, name in enumerate(names)
    ]
    results = run(engine, lines)
    eos = set(engine.lm.eos_ids)
    for (name, body), r in zip(lines, results, strict=True):
        assert r.status_code == 200, r.error
        ids = list(engine.lm.tokenizer(body["prompt"]).input_ids)
        assert r.completion is not None
        assert r.completion["choices"][0]["text"] == engine.decode(oracle.greedy(ids, 6, name, eos))
    assert engine.lora is not None
    assert engine.lora.slots.loads > 2  # adapters came and went through the two slots


def test_prefix_cache_never_shares_kv_between_adapters(
    make_engine: Callable[..., Engine], adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    """The same long prompt under an adapter, another adapter, the base, then the first
    adapter and the base again, in one run: only the repeats find cached blocks (each in
    its own adapter's), and every line gives PEFT's text for its own adapter."""
    engine = lora_engine(make_engine, adapters, max_loras=4, kv_block_size=16)
    prompt = " ".join(PROMPTS) * 3
    order: list[str | None] = ["attn-r8", "all-r16", None, "attn-r8", None]
    eos = set(engine.lm.eos_ids)
    ids = list(engine.lm.tokenizer(prompt).input_ids)
    assert len(ids) > 48
    results = run(
        engine, [(name, {"prompt": prompt, "max_tokens": 5, "temperature": 0}) for name in order]
    )
    for name, r in zip(order, results, strict=True):
        assert r.status_code == 200, r.error
        assert r.completion is not None
        assert r.completion["choices"][0]["text"] == engine.decode(oracle.greedy(ids, 5, name, eos))
    cached = [r.cached_tokens for r in results]
    assert cached[0] == cached[1] == cached[2] == 0
    assert cached[3] > 0 and cached[4] > 0


def test_adapter_rows_keep_every_parameter(
    make_engine: Callable[..., Engine], adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    """Echo scoring, n/best_of, stop strings, seeds, chat lines and grammars under an
    adapter: prompt logprobs are PEFT's, a chat line is its rendered prompt's completion,
    constrained JSON parses."""
    engine = lora_engine(make_engine, adapters, max_loras=4)
    name = "all-r16"
    prompt = PROMPTS[1]
    ids = list(engine.lm.tokenizer(prompt).input_ids)
    echo, best, stop, chat, as_text, schema = run(
        engine,
        [
            (name, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}),
            (name, {"prompt": prompt, "max_tokens": 6, "n": 2, "best_of": 3, "seed": 5}),
            (name, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [" "]}),
            (
                name,
                {
                    "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 6,
                    "temperature": 0,
                },
            ),
            (name, {"prompt": "user: hello there\nassistant:", "max_tokens": 6, "temperature": 0}),
            (
                name,
                {
                    "prompt": prompt,
                    "max_tokens": 40,
                    "seed": 1,
                    "response_format": {"type": "json_object"},
                },
            ),
        ],
    )
    for r in (echo, best, stop, chat, as_text, schema):
        assert r.status_code == 200, r.error
    assert echo.completion is not None
    lps = oracle.logprobs(ids, name)
    got = echo.completion["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None
    for j in range(1, len(ids)):
        assert abs(got[j] - lps[j - 1, ids[j]].item()) < TOL
    assert best.completion is not None and len(best.completion["choices"]) == 2
    assert stop.completion is not None
    assert " " not in stop.completion["choices"][0]["text"]
    assert chat.completion is not None and as_text.completion is not None
    assert (
        chat.completion["choices"][0]["message"]["content"]
        == (as_text.completion["choices"][0]["text"])
    )
    assert schema.completion is not None
    if schema.completion["choices"][0]["finish_reason"] == "stop":
        import json

        json.loads(schema.completion["choices"][0]["text"])


def test_unknown_and_malformed_adapters_are_refused_per_line(
    make_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    demo_path: Path,
    tmp_path: Path,
) -> None:
    """A name that is no adapter of the base, and an adapter above max_lora_rank: a 400
    naming `model` each; the other lines run."""
    engine = lora_engine(make_engine, adapters, max_loras=2, max_lora_rank=8)
    wide = build_adapter(demo_path, tmp_path / "wide", r=16, targets=["q_proj"], alpha=16, seed=9)
    assert engine.lora is not None
    engine.lora.store.register("wide", wide)
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    missing, too_wide, fine = run(engine, [("nope", body), ("wide", body), ("attn-r8", body)])
    assert missing.status_code == 400 and missing.error is not None
    assert missing.error["param"] == "model" and "nope" in missing.error["message"]
    assert too_wide.status_code == 400 and too_wide.error is not None
    assert "max_lora_rank 8" in too_wide.error["message"]
    assert fine.status_code == 200


def test_specs_cover_ranks_and_targets() -> None:
    ranks = {s["r"] for s in SPECS.values()}
    assert len(ranks) == 3


def test_online_adapter_rows_preempt_and_stream(
    make_engine: Callable[..., Engine], adapters: dict[str, Path]
) -> None:
    """Batch lines of two adapters fill the rows; streamed online requests of adapters
    arrive and preempt them: every batch line gives the text it gives without the online
    traffic (greedy and seeded), and each stream's deltas add up to its result."""
    from tests.engine.test_lane import Feed

    names = list(adapters)
    kinds: list[dict[str, Any]] = [
        {"max_tokens": 24, "temperature": 0},
        {"max_tokens": 20, "temperature": 1.0, "seed": 7, "n": 2},
        {"max_tokens": 18, "temperature": 0, "logprobs": 2, "stop": ["zz"]},
    ]

    def batch() -> list[GenRequest]:
        return [
            GenRequest(
                ("b", i),
                {"model": names[i % 2], "prompt": f"Line {i}: once upon", **kinds[i % 3]},
                group="batch",
                adapter=names[i % 2],
            )
            for i in range(8)
        ]

    alone = {r.key: r for r in serve(lora_engine(make_engine, adapters, max_rows=4), batch())}
    online = [
        GenRequest(
            ("o", i),
            {"model": names[2 - i], "prompt": f"Online {i}", "max_tokens": 8, "temperature": 0},
            stream=True,
            adapter=names[2 - i],
        )
        for i in range(2)
    ]
    feed = Feed({3: online[:1], 5: online[1:]})
    engine = lora_engine(make_engine, adapters, max_rows=4)
    mixed = {r.key: r for r in serve(engine, batch(), online=feed)}
    assert feed.lines > 0  # batch lines gave their rows up
    for key, r in alone.items():
        assert r.completion is not None and mixed[key].completion is not None
        assert [c["text"] for c in r.completion["choices"]] == [
            c["text"] for c in mixed[key].completion["choices"]
        ]
    for req in online:
        r = mixed[req.key]
        assert r.status_code == 200 and r.completion is not None
        assert r.completion["model"] == req.adapter
        streamed = "".join(d.get("text", "") for _, ds in feed.deltas[req.key] for d in ds)
        assert streamed == r.completion["choices"][0]["text"]
