"""What a model's attention variant costs the engine (docs/models.md).

(1) A sliding window that does not bind: the same Mistral-shaped weights with no window
and with a window of 1024 on a 2048-token context, on requests whose rows stay under 512
tokens. The target is >= 0.9x the no-window tokens/s.
(2) The reference path (transformers' own attention over the paged cache, padded.py)
against the fast path on the same model and requests.

Each leg runs on one pinned thread (`taskset -c 0` recommended) and is measured in CPU
seconds of this process (time.process_time), the legs alternating, best of `--rounds`.

    taskset -c 0 .venv/bin/python bench/models_bench.py [--requests 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

from batchwright.engine.engine import Engine
from batchwright.engine.loading.demo import EOS_TOKEN, build_tokenizer
from batchwright.engine.loading.loader import load_model
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import prepared


def build(path: Path, window: int | None) -> Path:
    tok = build_tokenizer(1000)
    eos = int(tok.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=window,
        bos_token_id=eos,
        eos_token_id=eos,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def requests(n: int, vocab: int) -> list[GenRequest]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(8, 256))]
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(16, 128)}
        out.append(GenRequest(i, {**body, "temperature": 0}))
    return out


def leg(engine: Engine, reqs: list[GenRequest]) -> tuple[float, int]:
    lines = prepared(engine, reqs)  # each line prepared as the engine reads it
    start = time.process_time()
    tokens = 0
    for result in engine.run(lines):
        assert result.status_code == 200, result.error
        tokens += result.completion_tokens
    return time.process_time() - start, tokens


def compare(a: Engine, b: Engine, reqs: list[GenRequest], rounds: int) -> tuple[float, float]:
    """Best tokens per CPU-second of `a` and `b`, the legs alternating."""
    best = [0.0, 0.0]
    leg(a, reqs[:8])
    leg(b, reqs[:8])
    for _ in range(rounds):
        for i, engine in enumerate((a, b)):
            seconds, tokens = leg(engine, reqs)
            best[i] = max(best[i], tokens / seconds)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bw-models-bench-"))
    plain_path = build(root / "plain", None)
    window_path = build(root / "window", 1024)

    def spec(path: Path) -> ModelSpec:
        return ModelSpec(name="m", path=path, device="cpu", max_rows=32, prefix_cache=False)

    plain = Engine.load(spec(plain_path))
    window = Engine.load(spec(window_path))
    vocab = plain.lm.vocab_size
    reqs = requests(args.requests, vocab)
    no_win, win = compare(plain, window, reqs, args.rounds)
    print(
        f"window 1024, rows < 512 tokens: {win:,.0f} tok/CPU-s against {no_win:,.0f} "
        f"without a window: {win / no_win:.2f}x (target >= 0.9x)"
    )
    reference = Engine(load_model(spec(plain_path), reference=True), spec(plain_path))
    few = reqs[: max(8, args.requests // 3)]
    fast, ref = compare(plain, reference, few, args.rounds)
    print(
        f"reference path: {ref:,.0f} tok/CPU-s against the fast path's {fast:,.0f}: "
        f"{ref / fast:.2f}x"
    )


if __name__ == "__main__":
    main()
