"""Throughput of the batchwright engine against plain transformers generation.

Prints generated tokens/s for the engine on heterogeneous requests, and ratios against:
(a) a loop of `model.generate` per request, (b) `generate` on padded static batches of
max_rows requests, (c) the engine on a homogeneous batch with the same token counts
(distinct prompts of one length, greedy: bench/_workloads.py). One revision against
another, in CPU-seconds on one pinned thread: bench/ab.py.

    .venv/bin/python bench/engine_bench.py            # CPU, 256 requests
    .venv/bin/python bench/engine_bench.py --quick    # smoke run
    .venv/bin/python bench/engine_bench.py --gpu      # Qwen2.5-0.5B-shaped model, bf16 on CUDA
                                                      # (8 x max_rows requests, a few minutes)
    python bench/engine_bench.py --gpu --engine-only [--no-graphs]   # bench/gpu_check.sh

On CUDA the engine runs as it does by default there (CUDA graphs, torch.compile);
`--no-graphs` replays no graph. The warm-up runs batches of two sizes first, so the
compiles (a second one makes shapes dynamic) land before anything is timed.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workloads import homogeneous, make_requests

from batchwright.engine.engine import Engine
from batchwright.engine.loading.demo import EOS_TOKEN, build_demo_model, build_tokenizer
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import prepared

H200_BW = 4.8e12
H200_BF16_FLOPS = 989e12  # dense
# Standard deviation of the GPU model's logits: random weights give about 0.6, a flat
# distribution over 152k tokens that no trained model has (and that makes every top_p row
# a wide nucleus); trained models sit at a few nats of entropy, which this scale gives.
GPU_LOGIT_STD = 4.0


def build_gpu_model(path: Path) -> Path:
    """Qwen2.5-0.5B shapes with random bf16 weights (no download possible)."""
    tok = build_tokenizer(1000)
    eos = int(tok.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        probe = torch.randint(1, 1000, (4, 64), device="cuda")
        std = float(model(input_ids=probe).logits.float().std())
        model.model.norm.weight.mul_(GPU_LOGIT_STD / std)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def build_cpu_model(path: Path, kv_heads: int | None = None) -> Path:
    """The CPU benchmarks' model: a 4.5M-parameter Llama (4 heads, vocab 4096)."""
    return build_demo_model(
        path,
        hidden_size=256,
        layers=4,
        heads=4,
        kv_heads=kv_heads,
        intermediate_size=768,
        max_position_embeddings=1024,
        model_vocab_size=4096,
    )


def run_engine(engine: Engine, bodies: list[dict[str, Any]]) -> tuple[int, float]:
    # Each line prepared as the engine reads it, as the timing always counted.
    reqs = prepared(engine, [GenRequest(i, b) for i, b in enumerate(bodies)])
    sync()
    t = time.perf_counter()
    tokens = 0
    for res in engine.run(reqs):
        assert res.status_code == 200, res.error
        tokens += res.completion_tokens
    sync()
    return tokens, time.perf_counter() - t


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_kwargs(body: dict[str, Any], eos: int) -> dict[str, Any]:
    n = body["max_tokens"]
    kw: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "pad_token_id": eos}
    if body["temperature"] > 0:
        kw.update(do_sample=True, temperature=body["temperature"], top_p=body["top_p"])
    else:
        kw.update(do_sample=False)
    return kw


@torch.inference_mode()
def run_hf_loop(
    model: Any, bodies: list[dict[str, Any]], eos: int, device: str
) -> tuple[int, float]:
    sync()
    t = time.perf_counter()
    tokens = 0
    for b in bodies:
        x = torch.tensor([b["prompt"]], device=device)
        out = model.generate(x, attention_mask=torch.ones_like(x), **hf_kwargs(b, eos))
        tokens += out.shape[1] - x.shape[1]
    sync()
    return tokens, time.perf_counter() - t


@torch.inference_mode()
def run_hf_static(
    model: Any, bodies: list[dict[str, Any]], eos: int, device: str, rows: int
) -> tuple[int, float]:
    """Padded static batches: each batch runs until its longest request is done."""
    sync()
    t = time.perf_counter()
    useful = 0
    for s in range(0, len(bodies), rows):
        group = bodies[s : s + rows]
        width = max(len(b["prompt"]) for b in group)
        ids = torch.full((len(group), width), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, b in enumerate(group):
            ids[i, width - len(b["prompt"]) :] = torch.tensor(b["prompt"])
            mask[i, width - len(b["prompt"]) :] = 1
        n = max(b["max_tokens"] for b in group)
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=True,
            temperature=1.0,
            pad_token_id=eos,
        )
        useful += sum(b["max_tokens"] for b in group)
    sync()
    return useful, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="64 smaller requests")
    ap.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B-shaped model on CUDA")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="max_rows (default 64; GPU 256)")
    ap.add_argument(
        "--loop-sample", type=int, default=None, help="requests timed for (a) (default all)"
    )
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="CPU model's key/value heads (default 4 = one per query head; 1 or 2 = GQA)",
    )
    ap.add_argument("--repeat", type=int, default=None, help="rounds, best kept (CPU: 3)")
    ap.add_argument(
        "--no-graphs", action="store_true", help="GPU: no CUDA graphs (the default has them)"
    )
    ap.add_argument(
        "--engine-only", action="store_true", help="only the engine's legs (no HF generate)"
    )
    args = ap.parse_args()

    torch.set_grad_enabled(False)
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="bw-bench-"))
    scale = 0.5 if args.quick else 1.0
    if args.gpu:
        device, rows = "cuda", args.rows or 256
        # At least 8 batches' worth, so the batch stays full most of the run.
        n = args.requests or 8 * rows
        path = build_gpu_model(tmp / "qwen-shape")
        spec = ModelSpec(
            name="bench",
            path=path,
            device="cuda",
            max_rows=rows,
            cuda_graphs=False if args.no_graphs else None,
        )
    else:
        device, rows = "cpu", args.rows or 64
        n = args.requests or (64 if args.quick else 256)
        path = build_cpu_model(tmp / "bench", kv_heads=args.kv_heads)
        spec = ModelSpec(name="bench", path=path, max_rows=rows, max_batch_tokens=4096)
    engine = Engine.load(spec)
    model = engine.lm.model
    eos = min(engine.lm.eos_ids)
    vocab = engine.lm.vocab_size
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {type(model).__name__} {params / 1e6:.1f}M params, vocab {vocab}, "
        f"heads {model.config.num_attention_heads}/{model.config.num_key_value_heads} kv, "
        f"{engine.lm.dtype} on {device}, max_rows {rows}, torch threads {torch.get_num_threads()}"
    )
    bodies = make_requests(n, vocab, eos, rng, scale=scale)
    hom_bodies = homogeneous(bodies, eos, vocab)
    if args.gpu:
        hf = model
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    # The whole set by default on CPU: a sample's mix of prompt and output lengths is not
    # the set's. On a GPU the loop is far too slow for that (and its rate is stable): 16.
    sample = args.loop_sample or (16 if args.quick or args.gpu else n)
    systems: dict[str, Callable[[], tuple[int, float]]] = {
        "engine, heterogeneous": lambda: run_engine(engine, bodies),
        "(c) engine, homogeneous batch": lambda: run_engine(engine, hom_bodies),
        f"(b) HF generate, static batches of {rows}": lambda: run_hf_static(
            hf, bodies, eos, device, rows
        ),
        f"(a) HF generate loop, {sample} requests": lambda: run_hf_loop(
            hf, bodies[:sample], eos, device
        ),
    }
    if args.engine_only:
        systems = dict(list(systems.items())[:2])
    # Warm-up so one-time costs (allocator, kernels) do not land on the first measurement.
    # Two sizes: on CUDA the second compiles the dynamic-shape graphs the run then uses.
    run_engine(engine, make_requests(4, vocab, eos, random.Random(1), scale=0.1))
    if args.gpu:
        run_engine(engine, make_requests(rows + 3, vocab, eos, random.Random(2), scale=0.1))
    # Rounds interleave the systems and each keeps its best time: a shared machine's noise
    # then slows every system alike instead of whichever happened to run in a bad moment.
    repeat = args.repeat or (1 if args.quick or args.gpu else 3)
    times: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, int] = {}
    for _ in range(repeat):
        for name, fn in systems.items():
            tokens[name], sec = fn()
            times[name].append(sec)
    tps = {}
    for name in systems:
        best = min(times[name])
        tps[name] = tokens[name] / best
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(
            f"{name}: {tokens[name]} tokens in {best:.2f}s = {tps[name]:.1f} tok/s "
            f"(best of {repeat}: {runs} s)"
        )
    eng_tps, hom_tps, *hf_tps = tps.values()
    if hf_tps:
        st_tps, lp_tps = hf_tps
        print(f"ratio engine/(a) loop:   {eng_tps / lp_tps:6.2f}x  (target >= 10)")
        print(f"ratio engine/(b) static: {eng_tps / st_tps:6.2f}x  (target >= 2)")
    print(f"ratio engine/(c) homog.: {eng_tps / hom_tps:6.2f}x  (target >= 0.8)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MiB")
    if args.gpu:
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
        ctx = sum(len(b["prompt"]) + b["max_tokens"] / 2 for b in bodies) / len(bodies)
        bound = rows * H200_BW / (2 * params + rows * ctx * kv_bytes)
        # Per token: 2 FLOPs per weight (the tied embedding once, as the output layer)
        # plus attention's 4 per query head, head dimension and context token.
        heads = cfg.num_attention_heads
        flops = 2 * params + 4 * cfg.num_hidden_layers * heads * head_dim * ctx
        compute = H200_BF16_FLOPS / flops
        floor = min(bound, compute)
        print(
            f"HBM bound at B={rows}, C={ctx:.0f}: {bound:.0f} tok/s; compute bound "
            f"(989 TFLOP/s bf16 dense, {flops / 1e9:.2f} GFLOP/token): {compute:.0f} tok/s"
        )
        print(
            f"engine reaches {eng_tps / bound:.1%} of the HBM bound, {eng_tps / floor:.1%} of "
            f"the lower of the two (homogeneous {hom_tps / bound:.1%}, {hom_tps / floor:.1%})"
        )
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
