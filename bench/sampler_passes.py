"""Full-vocabulary passes of the compiled sampling step: how often it sweeps [B, vocab].

Compiles `sample_step` with inductor (the CPU backend: it runs here) and reads the
generated code. A pass is one sweep over the vocabulary: a loop over [B, vocab] in a
generated kernel, or an extern op (topk) whose operand is [B, vocab]. Gathers and the
scatters that update the per-row state at the chosen token touch a few elements a row
and are not passes. The scatter that builds the probability histogram is lowered the way
inductor lowers it on CUDA (fused with its producer, atomic adds) rather than CPU's
default fallback (an int64 index tensor written out, then ATen's scatter).

One difference is reported, not hidden: inductor on CUDA computes a softmax's max and its
sum of exponentials in one online pass (`prepare_softmax_online`; the CPU backend has no
such codegen), so each "sum-exp" loop below that re-reads a tensor a "max" loop of the
same kernel read merges into that loop on CUDA. The CUDA figure is derived that way.
With --cuda (bench/gpu_check.sh) the step is compiled for the GPU, logits in bfloat16,
and the Triton kernels are counted instead: a reduction over the vocabulary counts its
loops (one when persistent), a kernel over [B, vocab] elements counts one.

Traffic: the bytes a step moves through [B, vocab] buffers, read off the same code: each
kernel or extern op reads or writes each [B, vocab] buffer it names once (a kernel that
loops over a row twice reads it from cache the second time on CPU, and in one online
pass on CUDA). Inputs are the logits as on CUDA (bfloat16) and the float32 state.

    .venv/bin/python bench/sampler_passes.py [--rows 8] [--vocab 50021] [--show-code]
    .venv/bin/python bench/sampler_passes.py --rows 256 --vocab 151936   # traffic target
    python bench/sampler_passes.py --cuda --rows 256 --vocab 151936
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

from batchwright.engine.sampling.sample_step import _RING, make_tables, sample_step

_KERNEL = re.compile(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''", re.S)
_LOOP = re.compile(
    r"for\(int64_t (x\d+)=static_cast<int64_t>\(0L\); \1<static_cast<int64_t>\((\d+)L\)"
)
_LOAD = re.compile(r"\b((?:in_out|in|out)_ptr\d+)\s*\+")
_INDEXED_ADD = re.compile(r"_ptr\d+\[static_cast<int64_t>\(tmp\d+\[\w+\][^\]]*\)\] \+=")
_TRITON = re.compile(r"(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", re.S)


@dataclass
class Traffic:
    """Bytes of [B, vocab] buffers each kernel or extern op of a step reads or writes."""

    per_op: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.per_op)


_CTYPE_BYTES = {"float": 4, "at::BFloat16": 2, "at::Half": 2, "int64_t": 8, "int32_t": 4, "bool": 1}
_SIGNATURE = re.compile(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[(.*?)\], r'", re.S)
_PARAMS = re.compile(r"extern \"C\"\s+void\s+kernel\((.*?)\)", re.S)


def traffic(code: str, rows: int, vocab: int, big: set[str]) -> Traffic:
    """What one call of inductor's (CPU backend) `code` for the step moves through its
    [B, vocab] buffers `big`: per kernel, the buffers its loops over the vocabulary
    touch; per extern op (topk), its [B, vocab] operand."""
    kernels = dict(_KERNEL.findall(code))
    types = {
        name: [s.strip(" '").removeprefix("const ").rstrip("*") for s in sig.split(",")]
        for name, sig in _SIGNATURE.findall(code)
    }
    call = code[code.index("def call(") :]
    calls = [
        (m.group(1), [a.strip() for a in m.group(2).split(",")])
        for m in re.finditer(r"^\s+(cpp_fused_\w+)\((.*)\)$", call, re.M)
    ]
    width: dict[str, int] = {}  # element bytes of each buffer, from the kernels' signatures
    for name, args in calls:
        for a, ctype in zip(args, types[name], strict=False):
            width.setdefault(a, _CTYPE_BYTES.get(ctype, 4))
    out = Traffic()
    for name, args in calls:
        head = _PARAMS.search(kernels[name])
        params = re.findall(r"(\w+_ptr\d+)", head.group(1)) if head is not None else []
        swept: set[str] = set()
        for _, ptrs in _loops(kernels[name], rows, vocab):
            swept |= ptrs
        named = {a for p, a in zip(params, args, strict=False) if p in swept and a in big}
        if named:
            out.per_op.append((name, sum(rows * vocab * width.get(a, 4) for a in named)))
    for m in re.finditer(r"aten\.(topk|sort)\.default\((\w+)", call):
        if m.group(2) in big:
            out.per_op.append((f"aten.{m.group(1)}", rows * vocab * width.get(m.group(2), 4)))
    return out


@dataclass
class Sweep:
    op: str
    kind: str  # "max", "sum-exp", "write", "scatter", "topk", ...
    reads: set[str] = field(default_factory=set)
    online: bool = False  # merges into an earlier max loop on CUDA


def _loops(src: str, rows: int, vocab: int) -> list[tuple[str, set[str]]]:
    """(kind, pointers read or written) of each loop over the vocabulary in a kernel (or
    over all of [B, vocab] flattened: a copy)."""
    heads = [m for m in _LOOP.finditer(src) if int(m.group(2)) in (vocab, rows * vocab)]
    out = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(src)
        body = src[m.start() : end]
        ptrs = set(_LOAD.findall(body))
        # On one thread inductor writes the scatter as a plain indexed += (atomic adds
        # when the kernel may run on several).
        if "atomic_add" in body or _INDEXED_ADD.search(body):
            kind = "scatter"
        elif "max_propagate_nan" in body or "maximum(" in body:
            kind = "max"
        elif "exp(" in body and "tmp_acc" in body:
            kind = "sum-exp"
        elif int(m.group(2)) == rows * vocab:
            kind = "copy"
        else:
            kind = "sweep"
        out.append((kind, ptrs))
    return out


def _triton_passes(src: str, rows: int, vocab: int) -> list[str]:
    """The kinds of a Triton kernel's sweeps over [B, vocab] (CUDA: measured)."""
    numel = re.search(r"\bxnumel = (\d+)", src)
    rnumel = re.search(r"\br0?_?numel = (\d+)", src)
    if rnumel is not None and int(rnumel.group(1)) == vocab:
        kind = "online" if "online_softmax" in src else "reduce"
        return [kind] * max(1, src.count("for r0_offset in range"))
    if numel is not None and int(numel.group(1)) == rows * vocab:
        return ["scatter" if "atomic_add" in src else "sweep"]
    return []


def inputs(
    rows: int, vocab: int, device: str = "cpu", logits_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """`sample_step`'s tensor arguments for a batch of sampled rows (seeded); logits in
    float32 on CPU and bfloat16 on CUDA unless `logits_dtype` says."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    dtype = logits_dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    tensors = [
        logits.to(dtype),  # logits
        torch.zeros(rows, vocab),  # offset
        torch.zeros(rows, vocab),  # counts
        torch.full((rows,), 1 / 0.7),  # inv_t
        torch.zeros(rows, dtype=torch.bool),  # greedy
        torch.full((rows,), 0.9),  # top_p
        torch.zeros(rows),  # presence
        torch.zeros(rows),  # frequency
        torch.rand(rows, _RING, generator=gen),  # ring
        torch.zeros(rows, dtype=torch.long),  # cursor
    ]
    return [t.to(device) for t in tensors]


LAST: dict[str, Traffic] = {}


def count(
    rows: int,
    vocab: int,
    k_top: int = 5,
    device: str = "cpu",
    logits_dtype: torch.dtype | None = None,
) -> tuple[list[Sweep], str, torch.Tensor]:
    """The passes of the compiled step, inductor's code, and the step's packed result
    (the step's traffic lands in LAST["traffic"])."""
    tables = make_tables(vocab, rows, torch.device(device))
    args = inputs(rows, vocab, device, logits_dtype)
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.fallback_scatter_reduce_sum": False}):
        fn: Callable[..., torch.Tensor] = torch.compile(sample_step, fullgraph=True)
        packed, codes = run_and_get_code(fn, *args, tables, k_top)
    code = codes[0]
    kernels = {name: src for name, src in _KERNEL.findall(code)}
    triton = {name: src for name, src in _TRITON.findall(code)}
    call = code[code.index("def call(") :]
    call = call[: call.index("runner = Runner")] if "runner = Runner" in call else call
    shape = rf"\({rows}, {vocab}\)"
    big = set(re.findall(rf"(buf\d+) = empty_strided_\w+\({shape}", call))
    big |= set(re.findall(rf"assert_size_stride\((arg\d+_1), {shape}", call))
    if not triton:
        LAST["traffic"] = traffic(code, rows, vocab, big)
    sweeps: list[Sweep] = []
    for line in call.splitlines():
        line = line.strip()
        name = line.split("(")[0]
        if name.endswith(".run") and name[: -len(".run")] in triton:
            name = name[: -len(".run")]
            sweeps.extend(Sweep(name, kind) for kind in _triton_passes(triton[name], rows, vocab))
        elif name in kernels:
            for kind, ptrs in _loops(kernels[name], rows, vocab):
                sweeps.append(Sweep(name, kind, ptrs))
            # A sum-exp loop over a tensor a max loop of the same kernel already read
            # is the second half of an online softmax on CUDA.
            maxed: set[str] = set()
            for s in (s for s in sweeps if s.op == name):
                if s.kind == "max":
                    maxed |= s.reads
                elif s.kind == "sum-exp" and s.reads & maxed:
                    s.online = True
        elif "aten." in line and "(" in line and not line.startswith(("assert", "#")):
            operands = set(re.findall(r"\b(?:arg\d+_1|buf\d+)\b", line.split("(", 1)[1]))
            op = re.search(r"aten\.(\w+)", line)
            if operands & big and op is not None and op.group(1) in ("topk", "sort", "cumsum"):
                sweeps.append(Sweep(f"aten.{op.group(1)}", op.group(1), operands & big))
    return sweeps, code, packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50021, help="odd, so it names no other size")
    ap.add_argument("--show-code", action="store_true", help="print inductor's output code")
    ap.add_argument("--cuda", action="store_true", help="compile for CUDA and count Triton's")
    a = ap.parse_args()
    device = "cuda" if a.cuda else "cpu"
    sweeps, code, _ = count(a.rows, a.vocab, device=device, logits_dtype=torch.bfloat16)
    if a.show_code:
        print(code)
    moved = LAST["traffic"]
    print(
        f"traffic through [B, vocab] buffers per step: {moved.total / 1e9:.2f} GB "
        f"({len(moved.per_op)} kernels and ops; logits bfloat16, state float32)"
    )
    for op, b in moved.per_op:
        print(f"    {b / 1e6:9.1f} MB  {op[:70]}")
    if a.cuda:
        print(f"compiled sample_step, B = {a.rows}, vocab = {a.vocab} (inductor, CUDA, measured)")
        for i, s in enumerate(sweeps, 1):
            print(f"{i:>2}  {s.op[:60]:<60} {s.kind}")
        print(f"passes over [B, vocab]: {len(sweeps)} on CUDA (measured)")
        return
    print(f"compiled sample_step, B = {a.rows}, vocab = {a.vocab} (inductor, CPU backend)")
    print(f"{'#':>2}  {'kernel or op':<60} {'loop':<8} on CUDA")
    for i, s in enumerate(sweeps, 1):
        cuda = "merges into the max pass (online softmax)" if s.online else "a pass"
        print(f"{i:>2}  {s.op[:60]:<60} {s.kind:<8} {cuda}")
    merged = sum(s.online for s in sweeps)
    print(
        f"passes over [B, vocab]: {len(sweeps)} on CPU (measured), "
        f"{len(sweeps) - merged} on CUDA (derived)"
    )


if __name__ == "__main__":
    main()
