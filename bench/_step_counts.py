"""What bench/step_profile.py counts in one step: host syncs, aten ops, Python calls and
the kernels CUDA would launch, observed on CPU.

Host syncs: every op that reads device data on the host (`is_nonzero` behind a Python
`if tensor`, `item` and `_local_scalar_dense`, `nonzero` and the other data-dependent
shapes, a boolean-mask index), `tolist` (forced on CPU, the step's read-back is the
`tolist` of its packed output), `.cpu()` of a device tensor, and tensors built from
Python lists other than through the engine's pinned non-blocking helper (a pageable
copy).

Ops: aten ops as the dispatcher sees them; views are apart. A cast is a view only when
it returns its input (`aten::to` to the same dtype): one that allocates and copies is an
op (in bfloat16, RMSNorm's and rotary's float32 round trips and `logits.float()` copy).

Launches (kernels CUDA would launch; `--cuda-launches`): one per eager op that computes
or copies (views, allocations and no-op casts launch nothing), more for the ops CUDA
runs as several kernels (`_MULTI`), and for code that torch.compile compiled, the
kernels of inductor's generated code as counted by `compiled_kernels`.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Ops whose output shape depends on data, or that read a value back: each is a sync on CUDA.
SYNC_OPS = {
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::repeat_interleave",
}
# Ops that allocate (or alias) without launching a kernel.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::resize_",
    "aten::set_",
}
# Ops CUDA runs as several kernels (estimates from their CUDA implementations; the
# counts bench/gpu_check.sh takes with torch.profiler on a device are the measurement):
# topk over a long row is a multi-block radix select (a pass per byte of the key, each a
# count and a prefix kernel, then gather and sort of the k); an index_put_ that
# accumulates sorts its indices first (deterministic, eager only: compiled, it is an
# atomic scatter); varlen_attn is the FlashAttention kernel and a zero fill of the
# random-number state it returns.
_MULTI = {
    "aten::topk": 8,
    "aten::sort": 4,
    "aten::index_put_": 1,  # accumulate=True: see launches_of
    "torch_attn::_varlen_attn": 2,
    "batchwright::varlen_reference": 2,  # its CPU stand-in (bench/step_profile.py)
}
_ACCUMULATE_SORT = 6


def launches_of(name: str, args: Any, kwargs: Any) -> int:
    if name in _NO_KERNEL:
        return 0
    if name == "aten::index_put_" and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
        return _ACCUMULATE_SORT
    return _MULTI.get(name, 1)


class Counts:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.sampling = 0  # of the ops, those of the sampler's step
        self.views = 0
        self.syncs: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.calls = 0
        self.host_calls = 0  # Python calls recording tokens on the host (per row)
        self.paused = 0

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())


def _storage(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


class OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.c = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.c.paused:
            return out
        name = func._schema.name
        view = func.is_view
        if view and name == "aten::to" and args and _storage(out) != _storage(args[0]):
            view = False  # a cast that copied
        if view:
            self.c.views += 1
        else:
            self.c.ops[name] += 1
            n = launches_of(name, args, kwargs)
            if n:
                self.c.launches[name] += n
        if name in SYNC_OPS:
            self.c.syncs[name] += 1
        if name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for t in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else [])
        ):
            self.c.syncs["bool-mask index"] += 1
        return out


@contextmanager
def _host_sync_hooks(counts: Counts) -> Iterator[None]:
    """Count the host-side calls that sync on CUDA and do not reach the dispatcher on CPU."""
    orig_tolist = torch.Tensor.tolist
    orig_cpu = torch.Tensor.cpu
    orig_tensor = torch.tensor

    def tolist(self: torch.Tensor) -> Any:
        if not counts.paused:
            counts.syncs["tolist"] += 1
        return orig_tolist(self)

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Of device data (on CUDA the step's read-back copies into pinned memory first,
        # and `.cpu()` of that is free; forced on CPU nothing is on a device).
        if not counts.paused and self.device.type != "cpu":
            counts.syncs["cpu()"] += 1
        return orig_cpu(self, *args, **kwargs)

    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The engine's host-to-device helper passes pin_memory (pinned and non-blocking
        # on CUDA, no sync); any other tensor built from a list is a pageable copy.
        if not counts.paused and not isinstance(data, torch.Tensor) and "pin_memory" not in kwargs:
            counts.syncs["tensor(list)"] += 1
        return orig_tensor(data, *args, **kwargs)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    torch.Tensor.cpu = cpu  # type: ignore[method-assign]
    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = orig_tolist  # type: ignore[method-assign]
        torch.Tensor.cpu = orig_cpu  # type: ignore[method-assign]
        torch.tensor = orig_tensor


PROF: list[Any] = [None]


@contextmanager
def profiled(counts: Counts) -> Iterator[None]:
    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not counts.paused:
            counts.calls += 1

    with _host_sync_hooks(counts), OpCounter(counts):
        PROF[0] = prof
        sys.setprofile(prof)
        try:
            yield
        finally:
            sys.setprofile(None)
            PROF[0] = None


# --- compiled code ---------------------------------------------------------------------------

_KERNEL_CALL = re.compile(
    r"^\s*(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|"
    r"torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\("
)


def compiled_kernels(source_code: str) -> Counter[str]:
    """Kernels one call of inductor's generated module launches: each fused kernel
    (`cpp_fused_*` on the CPU backend, `triton_*` on CUDA: inductor fuses the same nodes
    into one kernel on either, except the online softmax, which only changes loops inside
    a kernel), each extern call (a matmul is one cuBLAS kernel), each fallback op."""
    call = source_code[source_code.index("def call(") :]
    out: Counter[str] = Counter()
    for line in call.splitlines():
        m = _KERNEL_CALL.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name.startswith(("cpp_fused_", "triton_")):
            out["compiled kernel"] += 1
        elif name.startswith("extern_kernels."):
            out[name] += 1
        else:
            op = name.removesuffix(".default").replace("torch.ops.", "").replace("aten.", "aten::")
            op = op.replace(".", "::", 1) if "::" not in op else op
            out[op] += _MULTI.get(op, 1)
    return out


@contextmanager
def counting_compiled(active: list[Counts]) -> Iterator[None]:
    """While a compiled function runs: the dispatcher's modes are off (under a mode
    torch.compile runs the function eagerly), its generated code's kernels are counted."""
    from torch._inductor.output_code import CompiledFxGraph

    try:
        from batchwright.engine.platform.compiled import Compiled
    except ImportError:  # an engine from before it compiled anything (a baseline)
        yield
        return

    orig_graph, orig_call = CompiledFxGraph.__call__, Compiled.__call__
    cache: dict[int, Counter[str]] = {}

    def graph_call(self: Any, inputs: Any) -> Any:
        c = active[0] if active else None
        # Only the pause taken here is given back: inside a replay (already paused) the
        # compiled forward must not unpause the rest of the replayed step.
        counted = c is not None and not c.paused
        if counted:
            assert c is not None
            if id(self) not in cache:
                cache[id(self)] = compiled_kernels(self.source_code)
            c.launches.update(cache[id(self)])
            c.paused += 1
        try:
            return orig_graph(self, inputs)
        finally:
            if counted:
                assert c is not None
                c.paused -= 1

    def compiled_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return orig_call(self, *args, **kwargs)
        with _disable_current_modes():
            return orig_call(self, *args, **kwargs)

    CompiledFxGraph.__call__ = graph_call  # type: ignore[method-assign]
    Compiled.__call__ = compiled_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        CompiledFxGraph.__call__ = orig_graph  # type: ignore[method-assign]
        Compiled.__call__ = orig_call  # type: ignore[method-assign]
