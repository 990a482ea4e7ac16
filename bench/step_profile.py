"""Per-step host cost of the engine's decode loop: host syncs, aten ops, Python calls and
the kernels it launches.

Runs the engine on a Qwen2.5-0.5B-shaped model (24 layers, 14 query / 2 key-value heads)
with a small hidden size, in bfloat16 as on a GPU (`--dtype float32`: the CPU's dtype,
where casts are free), and profiles single steady-state decode steps (no admission in
the step) at B = 64 and 256 rows, for a greedy and a mixed parameter set. What counts as
a sync, an op and a launch: bench/_step_counts.py.

Without a GPU the CUDA code path is forced on CPU: the attention backend the engine picks
on CUDA runs, its one variable-length attention call per layer counted as the op it is
there (its CPU stand-in is not counted). Ops, syncs and Python calls are the eager
engine's (nothing compiled).

`--cuda-launches` counts the kernels a steady step would launch on CUDA, twice: the
engine as it runs on CUDA without graphs (forward and sampler compiled by torch.compile
-- on CPU inductor's CPU backend compiles them, and its kernels are counted one for one
with the Triton kernels CUDA would get -- the rest eager, one kernel per op, several for
topk and sorting scatters), and with CUDA graphs (the kernels the host still launches
around a replay, the replay one). The compiles take minutes on a small CPU.

With `--cuda` (bench/gpu_check.sh) it runs on the GPU for real: syncs counted by
`torch.cuda.set_sync_debug_mode`, kernels by torch.profiler.

    .venv/bin/python bench/step_profile.py [--rows 64 256] [--dtype float32] [--top 20]
    .venv/bin/python bench/step_profile.py --cuda-launches
    python bench/step_profile.py --cuda [--graphs]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from _step_counts import PROF, Counts, counting_compiled, launches_of, profiled

from batchwright.engine.attention import backends
from batchwright.engine.engine import Engine
from batchwright.engine.loading.demo import EOS_TOKEN, build_tokenizer
from batchwright.engine.output.processor import OutputProcessor
from batchwright.engine.requests.types import GenRequest
from batchwright.engine.runner import graphs, model_runner
from batchwright.engine.sampling.sampler import Sampler
from batchwright.registry import ModelSpec
from batchwright.serving.lines import prepared


def build_model(path: Path, hidden: int, vocab: int) -> Path:
    """Qwen2.5-0.5B's layer and head counts with a small hidden size, random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(1000)
    eos = int(tok.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 5,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bodies(rows: int, mix: str, eos: int, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(rows)
    out = []
    for i in range(rows):
        body: dict[str, Any] = {
            "model": "p",
            "prompt": [rng.randrange(1, 1000) for _ in range(rng.randint(8, 48))],
            "max_tokens": 64,
            "temperature": 0.0,
            "logit_bias": {str(eos): -100},
        }
        if mix == "mixed":
            body["temperature"] = rng.choice([0.0, 0.7, 1.0])
            body["top_p"] = rng.choice([1.0, 0.9])
            body["seed"] = i
            if i % 4 == 1:
                body["presence_penalty"], body["frequency_penalty"] = 0.5, 0.3
            if i % 5 == 2:
                body["stop"] = ["\n\n", "zzz"]
            if i % 7 == 3:
                body["logprobs"] = 2
            if i % 3 == 0:
                body["logit_bias"] = {str(eos): -100, str(rng.randrange(vocab)): 2.0}
        out.append(body)
    return out


_ACTIVE: list[Counts] = []


def _stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
    """varlen_attn's semantics on CPU: an opaque op, as torch's own (compiled, inductor
    keeps it whole and the generated code names it); eager, counted as the one op it is
    on CUDA, its CPU internals not."""
    if torch.compiler.is_compiling():
        return backends.varlen_reference_op(*args, **kwargs)
    c = _ACTIVE[0] if _ACTIVE else None
    if c is None:
        return backends.varlen_reference(*args, **kwargs)
    if not c.paused:
        c.ops["torch_attn::_varlen_attn"] += 1
        c.launches["torch_attn::_varlen_attn"] += launches_of("torch_attn::_varlen_attn", (), {})
    c.paused += 1
    try:
        return backends.varlen_reference(*args, **kwargs)
    finally:
        c.paused -= 1


def force_cuda_path(engine: Engine) -> None:
    """Make a CPU engine take the code path it takes on CUDA: the varlen backend, with
    varlen_attn's semantics computed on CPU by an op that counts as the one it is there."""
    engine.attention_backend = "varlen"
    backends.VARLEN_IMPL = _stand_in
    # On CUDA every batch runs the one fixed sampling graph (the shortcuts are CPU's).
    model_runner.Sampler = functools.partial(Sampler, shortcut=False)  # type: ignore[misc]


class _Profiled(Exception):
    pass


@contextmanager
def _replays_counted() -> Iterator[None]:
    """On CPU a graph's replay runs its step again (graphs.EagerCapture): count it as
    the one launch a replay is, and none of what it runs."""
    orig = graphs.EagerCapture.first

    def first(self: Any, body: Any) -> Any:
        out, _ = orig(self, body)

        def replay() -> torch.Tensor:
            c = _ACTIVE[0] if _ACTIVE else None
            if c is None:
                return body()
            c.launches["graph replay"] += 1
            c.paused += 1
            try:
                return body()
            finally:
                c.paused -= 1

        return out, replay

    graphs.EagerCapture.first = first  # type: ignore[method-assign]
    try:
        yield
    finally:
        graphs.EagerCapture.first = orig  # type: ignore[method-assign]


@contextmanager
def _cuda_profiled(counts: Counts) -> Iterator[None]:
    """On a GPU: syncs as CUDA reports them, kernels as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        yield
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("default")
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            counts.launches["cuda kernel" if "emcpy" not in e.name else "memcpy"] += 1


def profile_step(
    engine: Engine, reqs: list[dict[str, Any]], warm: int, graphs_on: bool = False
) -> Counts:
    """Counts of one decode step with no admission, `warm` such steps after the last
    admission. Python calls made while the host records each row's token (the output
    processor's `record`: detokenising, stop matching, results; per row by nature) are
    counted apart."""
    counts = Counts()
    cls = model_runner.ModelRunner
    orig = cls._step
    orig_push = OutputProcessor.record
    seen = {"decode": 0, "done": False}
    cuda = engine.lm.device.type == "cuda"
    engine.spec.cuda_graphs = graphs_on
    try:
        engine.new_runner()
    finally:
        engine.spec.cuda_graphs = None

    def push(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return orig_push(self, *args, **kwargs)
        c = _ACTIVE[0]
        before = c.calls
        c.paused += 1
        sys.setprofile(None)
        calls = Counter[str]()

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                calls["n"] += 1

        sys.setprofile(prof)
        try:
            return orig_push(self, *args, **kwargs)
        finally:
            sys.setprofile(None)
            c.host_calls += calls["n"]
            c.calls = before
            c.paused -= 1
            sys.setprofile(PROF[0])

    def step(self: Any, units: Any, *args: Any, **kwargs: Any) -> Any:
        if units or seen["done"]:
            seen["decode"] = 0
            return orig(self, units, *args, **kwargs)
        seen["decode"] += 1
        if seen["decode"] < warm:
            return orig(self, units, *args, **kwargs)
        seen["done"] = True
        _ACTIVE.append(counts)
        try:
            with _cuda_profiled(counts) if cuda else profiled(counts):
                orig(self, units, *args, **kwargs)
        finally:
            _ACTIVE.clear()
        raise _Profiled  # nothing more to measure: stop the run here

    orig_sample = Sampler.step

    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _ACTIVE[0].total_ops if _ACTIVE else 0
        try:
            return orig_sample(self, *args, **kwargs)
        finally:
            if _ACTIVE:
                _ACTIVE[0].sampling += _ACTIVE[0].total_ops - before

    cls._step = step  # type: ignore[method-assign]
    OutputProcessor.record = push  # type: ignore[method-assign]
    Sampler.step = sample  # type: ignore[method-assign]
    try:
        with ExitStack() as stack:
            if not cuda:
                stack.enter_context(counting_compiled(_ACTIVE))
                stack.enter_context(_replays_counted())
            lines = prepared(engine, [GenRequest(i, b) for i, b in enumerate(reqs)])
            for _ in engine.run(lines):
                pass
    except _Profiled:
        pass
    finally:
        cls._step = orig  # type: ignore[method-assign]
        OutputProcessor.record = orig_push  # type: ignore[method-assign]
        Sampler.step = orig_sample  # type: ignore[method-assign]
    return counts


def _engine(path: Path, rows: int, args: argparse.Namespace, compiled: bool) -> Engine:
    spec = ModelSpec(
        name="p",
        path=path,
        device="cuda" if args.cuda else "cpu",
        dtype=args.dtype,
        max_rows=rows,
        max_batch_tokens=1 << 16,
        native_attention=False,
        # On CUDA the engine's defaults; on CPU what they are on CUDA (given only when on:
        # older engines lack the setting, and the ops profile compares with them).
        **({"torch_compile": True} if compiled and not args.cuda else {}),
    )
    engine = Engine.load(spec)
    if not args.cuda:
        force_cuda_path(engine)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--hidden", type=int, default=112, help="hidden size (14 heads of 8)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cuda", action="store_true", help="run on CUDA for real")
    ap.add_argument(
        "--graphs", action="store_true", help="with --cuda: decode steps replay CUDA graphs"
    )
    ap.add_argument(
        "--cuda-launches",
        action="store_true",
        help="CPU: count the kernels a step would launch on CUDA, eager and with graphs",
    )
    ap.add_argument("--warm", type=int, default=4, help="decode steps before the profiled one")
    ap.add_argument("--top", type=int, default=0, help="print the N most frequent ops")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    path = build_model(Path(tempfile.mkdtemp(prefix="bw-prof-")) / "qwen", args.hidden, args.vocab)
    layers = 24
    where = "CUDA" if args.cuda else "CPU, CUDA path forced"
    print(
        f"model: Qwen2.5-0.5B shape, hidden {args.hidden}, {layers} layers, heads 14/2, "
        f"vocab {args.vocab}, {args.dtype}; {where}"
    )
    if args.cuda_launches or args.cuda:
        _launches(path, args, layers)
        return
    print(
        "rows  mix    syncs  ops(non-view)  sampling  rest/layer  views  python calls  "
        "(+ host per-row)  sync detail"
    )
    for rows in args.rows:
        engine = _engine(path, rows, args, compiled=False)
        eos = min(engine.lm.eos_ids)
        for mix in ("greedy", "mixed"):
            c = profile_step(engine, bodies(rows, mix, eos, args.vocab), args.warm)
            syncs = sum(c.syncs.values())
            detail = ", ".join(f"{k} {v}" for k, v in sorted(c.syncs.items()))
            print(
                f"{rows:4d}  {mix:6s} {syncs:5d}  {c.total_ops:13d}  "
                f"{c.sampling:8d}  {(c.total_ops - c.sampling) / layers:10.1f}  "
                f"{c.views:5d}  {c.calls:12d}  "
                f"{c.host_calls:16d}  {detail}"
            )
            if args.top:
                print("   ", ", ".join(f"{k} {v}" for k, v in c.ops.most_common(args.top)))


def _launches(path: Path, args: argparse.Namespace, layers: int) -> None:
    """Kernels per steady step: the engine as on CUDA (compiled), without and with graphs."""
    print("rows  mix    graphs  launches  per layer  syncs  detail")
    modes = [args.graphs] if args.cuda else [False, True]
    for rows in args.rows:
        engine = _engine(path, rows, args, compiled=True)
        eos = min(engine.lm.eos_ids)
        for mix in ("greedy", "mixed"):
            for graphs_on in modes:
                c = profile_step(engine, bodies(rows, mix, eos, args.vocab), args.warm, graphs_on)
                top = ", ".join(f"{k} {v}" for k, v in c.launches.most_common(args.top or 6))
                print(
                    f"{rows:4d}  {mix:6s} {'on' if graphs_on else 'off':6s}  "
                    f"{c.total_launches:8d}  {c.total_launches / layers:9.1f}  "
                    f"{sum(c.syncs.values()):5d}  {top}"
                )


if __name__ == "__main__":
    main()
