"""Embedding engine against sentence-transformers' `encode` on the same model and threads.

10,000 text inputs of 8-512 tokens (uniform), a random BERT-style encoder (MiniLM-sized by
default: hidden 384, 6 layers, 12 heads) built offline in sentence-transformers' layout.
sentence-transformers runs as its users run it: `encode(texts, batch_size=64)`, which
sorts by length itself; the engine gets the same texts as requests of 16 inputs and packs
them (engine/embed/). Both in this one process, the inputs split in chunks and the sides
alternating chunk by chunk (a machine whose load drifts skews both alike); CPU seconds of
the process are the measure, wall seconds are printed too. Run it pinned:

    taskset -c 0 python bench/embed_bench.py            # one thread (the default)
    python bench/embed_bench.py --inputs 2000 --layers 2  # quicker, smaller

Prints inputs per CPU-second of each side, their ratio, and the agreement of the vectors
(cosine, max abs difference) as a check that both computed the same thing.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def texts_of(tokenizer: object, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """`n` texts whose token counts (special tokens included) are uniform in [lo, hi]."""
    vocab = [w for w in tokenizer.get_vocab() if w.isalpha() and not w.startswith("##")]  # type: ignore[attr-defined]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        words = [rng.choice(vocab) for _ in range(max(1, target - 2))]
        ids = tokenizer(" ".join(words))["input_ids"]  # type: ignore[operator]
        while len(ids) > target and len(words) > 1:
            words = words[: len(words) - (len(ids) - target)]
            ids = tokenizer(" ".join(words))["input_ids"]  # type: ignore[operator]
        out.append(" ".join(words))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=10_000)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="engine tokens per forward")
    ap.add_argument("--per-request", type=int, default=16, help="inputs per engine request")
    ap.add_argument("--model", type=Path, help="a sentence-transformers folder to use instead")
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from batchwright.engine.embed.engine import EmbedEngine
    from batchwright.engine.embed.tiny import build_encoder
    from batchwright.registry import ModelSpec

    tmp = tempfile.TemporaryDirectory()
    path = args.model or build_encoder(
        Path(tmp.name) / "enc",
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        max_position_embeddings=512,
    )
    st = SentenceTransformer(str(path), device="cpu")
    engine = EmbedEngine.load(
        ModelSpec(name="bench", path=path, device="cpu", max_batch_tokens=args.batch_tokens)
    )
    texts = texts_of(engine.lm.tokenizer, args.inputs, args.min_tokens, args.max_tokens, 0)
    tokens = sum(len(x) for x in engine.lm.tokenizer(texts)["input_ids"])
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads; "
        f"{len(texts)} inputs, {tokens} tokens ({tokens / len(texts):.0f} a input); "
        f"{torch.get_num_threads()} thread(s)"
    )

    def run_st(chunk: list[str]) -> np.ndarray:
        out: np.ndarray = st.encode(chunk, batch_size=64, convert_to_numpy=True)
        return out

    def run_engine(chunk: list[str]) -> np.ndarray:
        k = args.per_request
        jobs = [engine.job(i, chunk[i : i + k]) for i in range(0, len(chunk), k)]
        got = {o.job.key: o.vectors for o in engine.run(jobs)}  # type: ignore[union-attr]
        return np.stack([v.numpy() for i in sorted(got) for v in got[i]])

    # Warm both (allocator, kernels) on a few inputs before measuring.
    run_st(texts[:64])
    run_engine(texts[:64])
    cpu = {"sentence-transformers": 0.0, "batchwright": 0.0}
    wall = dict(cpu)
    ref_parts, got_parts = [], []
    size = -(-len(texts) // args.chunks)
    for c in range(args.chunks):
        chunk = texts[c * size : (c + 1) * size]
        order = [("sentence-transformers", run_st), ("batchwright", run_engine)]
        if c % 2:
            order.reverse()
        for name, fn in order:
            t0, w0 = time.process_time(), time.perf_counter()
            out = fn(chunk)
            cpu[name] += time.process_time() - t0
            wall[name] += time.perf_counter() - w0
            (ref_parts if name == "sentence-transformers" else got_parts).append(out)
        print(
            f"chunk {c + 1}/{args.chunks}: " + ", ".join(f"{k} {v:.1f} s" for k, v in cpu.items())
        )
    ref, got = np.concatenate(ref_parts), np.concatenate(got_parts)
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    print(f"agreement: min cosine {cos.min():.7f}, max abs diff {np.abs(ref - got).max():.2e}")
    for name in cpu:
        print(
            f"{name}: {len(texts) / cpu[name]:.1f} inputs per CPU-second "
            f"({cpu[name]:.1f} CPU s, {wall[name]:.1f} wall s)"
        )
    ratio = cpu["sentence-transformers"] / cpu["batchwright"]
    print(f"ratio (inputs/s, batchwright / sentence-transformers): {ratio:.2f}x")


if __name__ == "__main__":
    main()
