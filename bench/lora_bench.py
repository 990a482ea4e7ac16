"""LoRA adapters mixed in one batch against the same lines on the base alone, in one run.

256 lines over 8 rank-16 adapters (every linear layer of the decoder: q/k/v/o and
gate/up/down; lines assigned round-robin, so every decode step mixes all eight and some
base-less rows' neighbours), against the same 256 lines on the base model, the two legs
alternating (`--rounds`), each timed in CPU seconds of this process (pin it:
`taskset -c 0`; one torch thread). Tokens/s = generated tokens / CPU seconds.

Then memory: the engine's resident growth with the 8 adapters held (slot stacks and the
adapters' host copies) against 8 merged copies of the model (PEFT's merge_and_unload,
each a whole model), on this machine's RSS and by tensor bytes.

    taskset -c 0 .venv/bin/python bench/lora_bench.py            # the issue's figures
    taskset -c 0 .venv/bin/python bench/lora_bench.py --quick    # smoke run

Models: engine_bench.py's CPU model (a 4.5M-parameter Llama, hidden 256, 4 layers).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import build_cpu_model

from batchwright.engine.engine import Engine
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import prepared

ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(base: Path, root: Path, n: int) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + i)
            peft_model = get_peft_model(model, config)
        path = root / f"lora-{i}"
        peft_model.save_pretrained(path)
        out[path.name] = path
    return out


def make_lines(n: int, vocab: int, eos: int, scale: float) -> list[dict[str, Any]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        plen = rng.randint(16, int(128 * scale))
        out.append(
            {
                "model": "bench",
                "prompt": [rng.randrange(1, vocab) for _ in range(plen)],
                "max_tokens": rng.randint(16, int(96 * scale)),
                "temperature": rng.choice([0.0, 0.8]),
                "seed": i,
                "logit_bias": {str(eos): -100},  # every line runs to max_tokens
            }
        )
    return out


def leg(engine: Engine, lines: list[dict[str, Any]], names: list[str | None]) -> tuple[float, int]:
    reqs = [
        GenRequest(i, {**body, "model": name or "bench"}, adapter=name)
        for i, (body, name) in enumerate(zip(lines, names, strict=True))
    ]
    lines_in = prepared(engine, reqs)  # each line prepared as the engine reads it
    start = time.process_time()
    tokens = 0
    for r in engine.run(lines_in):
        assert r.status_code == 200, r.error
        tokens += r.completion_tokens
    return time.process_time() - start, tokens


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def tensor_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memory(base: Path, adapters: dict[str, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    before = rss()
    engine = Engine.load(ModelSpec(name="bench", path=base, max_rows=64, max_loras=ADAPTERS))
    assert engine.lora is not None
    for name, path in adapters.items():
        engine.lora.store.register(name, path)
        engine.lora.slots.acquire(engine.lora.store.request(name).result(), set())
    lora_rss = rss() - before
    base_bytes = tensor_bytes(engine.lm.model)
    slots = sum(
        t.numel() * t.element_size()
        for layer in engine.lora.wrapped.layers
        for t in (layer.a, *layer.b, layer.at, layer.bd)
        if t is not None
    )
    host = sum(
        sum(a.numel() * 4 + b.numel() * 4 for a, b, _ in w.tensors.values())
        for w in (engine.lora.store.request(n).result() for n in adapters)
    )
    del engine
    gc.collect()
    before = rss()
    merged = []
    for path in adapters.values():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged.append(PeftModel.from_pretrained(model, path).merge_and_unload())
    merged_rss = rss() - before
    merged_bytes = sum(tensor_bytes(m) for m in merged)
    print(
        f"memory: base + {ADAPTERS} adapters: +{lora_rss / 2**20:.1f} MiB RSS "
        f"(weights {base_bytes / 2**20:.1f} MiB + slot stacks {slots / 2**20:.1f} MiB "
        f"+ adapters' host copies {host / 2**20:.1f} MiB); "
        f"{ADAPTERS} merged copies: +{merged_rss / 2**20:.1f} MiB RSS "
        f"(weights {merged_bytes / 2**20:.1f} MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    if args.memory_only:
        with tempfile.TemporaryDirectory() as tmp:
            base = build_cpu_model(Path(tmp) / "base")
            memory(base, build_adapters(base, Path(tmp), ADAPTERS))
        return
    torch.set_num_threads(1)
    lines_n = 32 if args.quick else args.lines
    scale = 0.25 if args.quick else 1.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_cpu_model(root / "base")
        adapters = build_adapters(base, root, ADAPTERS)
        spec = ModelSpec(name="bench", path=base, max_rows=64, max_loras=ADAPTERS)
        engine = Engine.load(spec)
        assert engine.lora is not None
        for name, path in adapters.items():
            engine.lora.store.register(name, path)
        tok = engine.lm.tokenizer
        lines = make_lines(lines_n, engine.lm.vocab_size, int(tok.eos_token_id), scale)
        names = list(adapters)
        mixed: list[str | None] = [names[i % len(names)] for i in range(lines_n)]
        plain: list[str | None] = [None] * lines_n
        leg(engine, lines[:8], mixed[:8])  # warm-up: adapters read, kernels built
        print(
            f"{lines_n} lines, {ADAPTERS} adapters of rank {RANK} on {', '.join(TARGETS)}; "
            f"threads {torch.get_num_threads()}, pid {os.getpid()}"
        )
        best = {"base": 0.0, "lora": 0.0}
        for r in range(args.rounds):
            order = [("base", plain), ("lora", mixed)]
            if r % 2:
                order.reverse()
            for label, which in order:
                cpu, tokens = leg(engine, lines, which)
                rate = tokens / cpu
                best[label] = max(best[label], rate)
                print(
                    f"round {r + 1} {label:4s}: {tokens} tokens in {cpu:.1f} CPU s "
                    f"= {rate:.0f} tok/s"
                )
        print(
            f"mixed adapters / base alone: {best['lora'] / best['base']:.2f}x tokens/s "
            f"(best of {args.rounds} each, alternating)"
        )
        del engine
        memory(base, adapters)


if __name__ == "__main__":
    main()
