"""Parity per architecture: batchwright's greedy text and logprobs equal HF `generate` of
the same model, on the fast path (native decode attention on CPU, and the reference
backend the CUDA path falls back to) and on the reference path (transformers' own
attention over the paged cache). docs/models.md is checked against CASES below.

Prompts are long enough for a window of 16 to bind on prompts, decode rows and cached
prefixes (two prompts share their first 32 tokens: with 16-token blocks the second
prefills from the first's cached blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchwright.engine.engine import Engine
from batchwright.engine.loading.loader import load_model
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import serve
from tests.engine.model_zoo import ZOO, build

STEPS = 8
_SHARED = (
    "Once upon a time there was a little model that learned to write stories about the sea, "
    "the mountains, the rivers and the people who lived in the small towns along the coast"
)
PROMPTS = [
    "The quick brown fox",
    "A",
    _SHARED + " and",
    _SHARED + " where",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in many documents. Questions:",
    "Why is the sky blue? Because",
    "def add(a, b): return a + b; for i in range(10): print(i); if x > 0: y = x * 2.",
    "She said hello, he said goodbye, and they walked",
]
# The path each architecture takes on CPU: "fast" (batchwright's attention) or
# "reference" (transformers' own attention, padded.py), and why.
CASES: dict[str, str] = {name: "fast" for name in ZOO}
# GPT-Neo's attention does not go through transformers' attention interface.
CASES["gpt_neo"] = "reference"
# Cases whose attention differs from plain (windows, soft-capping, sinks, MLA widths): the
# reference backend, which other tests hold to the native one on plain models, runs too.
VARIANTS = {"mistral_window16", "gemma2", "gemma3", "cohere2", "gpt_oss", "deepseek_v3"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


Greedy = list[tuple[list[int], list[float]]]


def hf_greedy(path: Path) -> tuple[Greedy, float]:
    """HF generate, one prompt at a time: generated ids and each one's logprob; and the
    smallest margin between the best and second-best token over all steps."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    margin = float("inf")
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        gen = model.generate(
            ids,
            max_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[0, ids.shape[1] :].tolist()
        lps, gaps = [], [float("inf")]
        for t, logits in zip(new, gen.logits, strict=False):
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            lps.append(float(lp[t]))
            top = lp.topk(2).values
            gaps.append(float(top[0] - top[1]))
        out.append((new, lps))
        margin = min(margin, *gaps)
    return out, margin


def reference_model(name: str, root: Path) -> tuple[Path, Greedy]:
    """The zoo model built with the first seed whose greedy text has no near-tie (under
    2e-4 nats between the two best tokens, 100 times what the engine and HF differ by:
    kernels that round differently, on another CPU, could flip it), and HF's greedy text
    of it."""
    for seed in range(8):
        path = build(name, root / f"seed{seed}", seed)
        want, margin = hf_greedy(path)
        if margin > 2e-4:
            return path, want
    raise AssertionError(f"{name}: every seed tried has a near-tie")


def engine_greedy(engine: Engine) -> list[tuple[str, list[float]]]:
    bodies = [
        {"model": "m", "prompt": p, "max_tokens": STEPS, "temperature": 0, "logprobs": 1}
        for p in PROMPTS
    ]
    reqs = [GenRequest(i, b) for i, b in enumerate(bodies)]
    got = {r.key: r for r in serve(engine, reqs)}
    out = []
    for i in range(len(PROMPTS)):
        assert got[i].status_code == 200, got[i].error
        choice = got[i].completion["choices"][0]  # type: ignore[index]
        out.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return out


def compare(engine: Engine, want: Greedy) -> None:
    eos = engine.lm.eos_ids
    for (text, lps), (ids, hf_lps) in zip(engine_greedy(engine), want, strict=True):
        if ids and ids[-1] in eos:
            ids, hf_lps = ids[:-1], hf_lps[:-1]
        assert text == engine.decode(ids)
        assert lps[: len(hf_lps)] == pytest.approx(hf_lps, abs=1e-4)


def spec(path: Path) -> ModelSpec:
    return ModelSpec(
        name="m", path=path, device="cpu", max_rows=4, max_batch_tokens=512, kv_block_size=16
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_and_logprobs_equal_hf_generate(name: str, zoo: Path) -> None:
    path, want = reference_model(name, zoo)
    fast = Engine.load(spec(path))
    path_taken = "reference" if fast.lm.reference_reason else "fast"
    assert path_taken == CASES[name], fast.lm.reference_reason
    compare(fast, want)
    if path_taken == "fast":
        if name in VARIANTS:
            # The reference backend (SDPA over gathered pages: CUDA's fallback).
            fast.attention_backend = "reference"
            compare(fast, want)
        compare(Engine(load_model(spec(path), reference=True), spec(path)), want)


def test_docs_models_table_is_these_cases() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    table = doc.split("<!-- models table: checked by tests/engine/test_models.py -->")[1]
    table = table.split("<!-- end of models table -->")[0]
    rows = [
        [c.strip() for c in ln.strip().strip("|").split("|")]
        for ln in table.splitlines()
        if ln.startswith("| `")
    ]
    assert {r[0].strip("`"): r[3] for r in rows} == CASES
    for r in rows:
        name = r[0].strip("`")
        assert r[2] == ZOO[name][1]
        assert ("reference backend" in r[5]) == (name in VARIANTS)


@pytest.mark.parametrize("name", ["mistral_window16", "gemma3", "cohere2", "gpt_oss"])
def test_the_cuda_paths_varlen_call_applies_windows_and_sinks(
    name: str, zoo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the CUDA backend passes varlen_attn (window_size, sinks through the returned
    # log-sum-exp), computed on CPU with varlen_attn's semantics per sequence.
    from batchwright.engine.attention import backends

    monkeypatch.setattr(backends, "VARLEN_IMPL", backends.varlen_reference)
    path, want = reference_model(name, zoo)
    engine = Engine.load(spec(path))
    engine.attention_backend = "varlen"
    compare(engine, want)
