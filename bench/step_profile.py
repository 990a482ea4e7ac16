"""Per-step host cost of the engine's decode loop: host syncs, aten ops and Python calls.

Runs the engine on a Qwen2.5-0.5B-shaped model (24 layers, 14 query / 2 key-value heads)
with a small hidden size, and profiles single steady-state decode steps (no admission in
the step) at B = 64 and 256 rows, for a greedy and a mixed parameter set.

Without a GPU the CUDA code path is forced on CPU: the attention backend the engine picks
on CUDA runs, with its one variable-length attention call per layer counted as one op
(its CPU stand-in is not counted). Host syncs are counted by instrumenting what would
sync on CUDA: scalar reads (`item`, `int(t)`, `tolist`), tensors built from Python lists
(a pageable host-to-device copy), and data-dependent shapes (`nonzero`, boolean masks).
On CUDA `torch.cuda.set_sync_debug_mode` counts them for real.

    .venv/bin/python bench/step_profile.py [--rows 64 256] [--vocab 32768] [--cuda]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchwright.engine import backends
from batchwright.engine import scheduler as sched_mod
from batchwright.engine.demo import EOS_TOKEN, build_tokenizer
from batchwright.engine.runtime import Engine
from batchwright.engine.sampler import Sampler
from batchwright.engine.types import GenRequest
from batchwright.registry import ModelSpec

# Ops whose output shape depends on data, or that read a value back: each is a sync on CUDA.
_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::repeat_interleave",
}


class Counts:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.sampling = 0  # of the ops, those of the sampler's step
        self.views = 0
        self.syncs: Counter[str] = Counter()
        self.calls = 0
        self.host_calls = 0  # Python calls recording tokens on the host (per row)
        self.paused = 0

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.c = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.c.paused:
            name = func._schema.name
            if func.is_view:
                self.c.views += 1
            else:
                self.c.ops[name] += 1
            if name in _SYNC_OPS:
                self.c.syncs[name] += 1
            if name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool
                for t in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else [])
            ):
                self.c.syncs["bool-mask index"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _host_sync_hooks(counts: Counts) -> Iterator[None]:
    """Count the host-side calls that sync on CUDA and do not reach the dispatcher on CPU."""
    orig_tolist = torch.Tensor.tolist
    orig_tensor = torch.tensor

    def tolist(self: torch.Tensor) -> Any:
        if not counts.paused:
            counts.syncs["tolist"] += 1
        return orig_tolist(self)

    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The engine's host-to-device helper passes pin_memory (pinned and non-blocking
        # on CUDA, no sync); any other tensor built from a list is a pageable copy.
        if not counts.paused and not isinstance(data, torch.Tensor) and "pin_memory" not in kwargs:
            counts.syncs["tensor(list)"] += 1
        return orig_tensor(data, *args, **kwargs)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = orig_tolist  # type: ignore[method-assign]
        torch.tensor = orig_tensor


_PROF: list[Any] = [None]


@contextmanager
def profiled(counts: Counts) -> Iterator[None]:
    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not counts.paused:
            counts.calls += 1

    with _host_sync_hooks(counts), _OpCounter(counts):
        _PROF[0] = prof
        sys.setprofile(prof)
        try:
            yield
        finally:
            sys.setprofile(None)
            _PROF[0] = None


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


def force_cuda_path(engine: Engine, counts_of: Callable[[], Counts | None]) -> None:
    """Make a CPU engine take the code path it takes on CUDA: the varlen backend, with
    varlen_attn's semantics computed on CPU and counted as the one op it is there."""

    def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
        c = counts_of()
        if c is not None:
            c.ops["torch_attn::_varlen_attn"] += 1
            c.paused += 1
        try:
            return backends.varlen_reference(*args, **kwargs)
        finally:
            if c is not None:
                c.paused -= 1

    engine.attention_backend = "varlen"
    backends.VARLEN_IMPL = stand_in
    # On CUDA every batch runs the one fixed sampling graph (the shortcuts are CPU's).
    sched_mod.Sampler = functools.partial(Sampler, shortcut=False)  # type: ignore[misc]


_ACTIVE: list[Counts] = []


class _Profiled(Exception):
    pass


def profile_step(engine: Engine, reqs: list[dict[str, Any]], warm: int) -> Counts:
    """Counts of one decode step with no admission, `warm` such steps after the last
    admission. Python calls made while the host records each row's token (`_push`:
    detokenising, stop matching, results; per row by nature) are counted apart."""
    counts = Counts()
    cls = sched_mod.Scheduler
    orig = cls._step
    orig_push = cls._push
    seen = {"decode": 0, "done": False}

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
            sys.setprofile(_PROF[0])

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
            with profiled(counts):
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
    cls._push = push  # type: ignore[method-assign]
    Sampler.step = sample  # type: ignore[method-assign]
    try:
        for _ in engine.run([GenRequest(i, b) for i, b in enumerate(reqs)]):
            pass
    except _Profiled:
        pass
    finally:
        cls._step = orig  # type: ignore[method-assign]
        cls._push = orig_push  # type: ignore[method-assign]
        Sampler.step = orig_sample  # type: ignore[method-assign]
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--hidden", type=int, default=112, help="hidden size (14 heads of 8)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--cuda", action="store_true", help="run on CUDA (bf16) for real")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="with --cuda: decode steps replay CUDA graphs (a replay launches no aten op)",
    )
    ap.add_argument("--warm", type=int, default=4, help="decode steps before the profiled one")
    ap.add_argument("--top", type=int, default=0, help="print the N most frequent ops")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    path = build_model(Path(tempfile.mkdtemp(prefix="bw-prof-")) / "qwen", args.hidden, args.vocab)
    layers = 24
    print(
        f"model: Qwen2.5-0.5B shape, hidden {args.hidden}, {layers} layers, heads 14/2, "
        f"vocab {args.vocab}; {'CUDA' if args.cuda else 'CPU, CUDA path forced'}"
    )
    print(
        "rows  mix    syncs  ops(non-view)  sampling  rest/layer  views  python calls  "
        "(+ host per-row)  sync detail"
    )
    for rows in args.rows:
        spec = ModelSpec(
            name="p",
            path=path,
            device="cuda" if args.cuda else "cpu",
            max_rows=rows,
            max_batch_tokens=1 << 16,
            native_attention=False,
            cuda_graphs=args.cuda and args.graphs,
        )
        engine = Engine.load(spec)
        if not args.cuda:
            force_cuda_path(engine, lambda: _ACTIVE[0] if _ACTIVE else None)
        eos = min(engine.lm.eos_ids)
        for mix in ("greedy", "mixed"):
            if args.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            c = profile_step(engine, bodies(rows, mix, eos, args.vocab), args.warm)
            if args.cuda:
                torch.cuda.set_sync_debug_mode("default")
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


if __name__ == "__main__":
    main()
