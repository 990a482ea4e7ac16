"""Batch invariance on CPU: a row's logits the same bits whatever shares its forward.

A preempted line is computed again from its prompt beside other rows (scheduling/preempt.py),
and a seeded line must give the same text whatever else is in its batch. Both hold bit for
bit only if nothing a row goes through depends on its neighbours. On the native backend
(CPU, float32) two things did:

- fp32 GEMM (MKL) gives a row other bits when the rows come in a count its micro-kernel
  does not tile evenly (measured here, AVX2, 1 and 2 threads: identical for every multiple
  of 4 rows, at any position; M = 1-3 and the tail rows of M = 5-11 differ). The step pads
  its tokens, and the rows it keeps for the output layer, to that multiple. oneDNN's
  kernels with a reordered weight (loading/onednn.py, the default on CPU) give the same
  bits at any row count: the multiple is then 1 and nothing is padded.
- a prompt attended through SDPA, its first decode through the paged kernel: a line
  recomputed with its generated tokens in a prompt got other bits. Every prompt token now
  goes through the paged kernel, each as a decode row would (attention/interface.py).

The multiple depends on the BLAS, the CPU and the thread count, so it is measured at load
on the model's own layers as they run (`rows_multiple`), not assumed; where none of the candidates
holds, the engine says so in one line and keeps the weaker guarantee (docs/engine.md).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Row counts tried, smallest first: any (oneDNN), then what GEMM micro-kernels tile by
# on x86 (MKL).
_CANDIDATES = (1, 4, 8, 16, 6, 12, 24, 32)
# Row counts a multiple of 1 is checked at besides 1 to 3: a decode step's, a prefill's.
_ANY_ROWS = (5, 7, 64, 67, 130)


def _holds(layer: torch.nn.Module, multiple: int, gen: torch.Generator) -> bool:
    """Whether a row of `layer`'s product has the same bits at every position of M =
    multiple, 2 x multiple and 3 x multiple rows (and a few more row counts for 1)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    k = weight.shape[1]
    row = torch.randn(k, generator=gen, dtype=weight.dtype)
    want: torch.Tensor | None = None
    counts = (multiple, 2 * multiple, 3 * multiple) + (_ANY_ROWS if multiple == 1 else ())
    for m in counts:
        x = torch.randn(m, k, generator=gen, dtype=weight.dtype)
        for pos in sorted({0, multiple - 1, m // 2, m - 1}):
            x[pos] = row
            got = layer(x)[pos]
            if want is None:
                want = got
            elif not torch.equal(got, want):
                return False
            x[pos] = torch.randn(k, generator=gen, dtype=weight.dtype)
    return True


def rows_multiple(model: torch.nn.Module) -> int | None:
    """The smallest row count whose multiples give every linear layer of `model` (one
    layer per distinct shape, run as the model runs it) row-invariant results on this
    machine; None if none does."""
    layers: dict[tuple[int, ...], torch.nn.Module] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(w, torch.Tensor):
            layers.setdefault(tuple(w.shape), module)
    get_output = getattr(model, "get_output_embeddings", None)
    out = get_output() if callable(get_output) else None
    out_weight = getattr(out, "weight", None)
    if isinstance(out, torch.nn.Module) and isinstance(out_weight, torch.Tensor):
        layers.setdefault(tuple(out_weight.shape), out)
    if not layers:
        return None
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for multiple in _CANDIDATES:
                if all(_holds(layer, multiple, gen) for layer in layers.values()):
                    return multiple
    except (RuntimeError, NotImplementedError, TypeError) as exc:  # weights F.linear cannot take
        log.warning("batch invariance unavailable: its check failed (%s)", exc)
        return None
    log.warning(
        "batch invariance unavailable: this CPU's matrix multiply gives a row other bits "
        "with other rows beside it for every row count tried (%s); a line's text can "
        "differ at near ties with what shares its steps (docs/engine.md)",
        ", ".join(map(str, _CANDIDATES)),
    )
    return None
