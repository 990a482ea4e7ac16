"""CPU linear layers through oneDNN, their weights reordered once at load.

ATen's float32 CPU matmul is MKL's sgemm. oneDNN's kernels, given a weight reordered once
into their own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's
CPU freezing pass does), ran 1.2-1.7x as fast on this project's shapes (docs/engine.md:
a decode step's [64, 512] x [512, 3,072] at 93 against 72 GFLOP/s, a prefill's
[400, 512] x [512, 3,072] at 99 against 59, an encoder's [5,400, 384] x [384, 1,536] at
106 against 86, one thread of an AMD EPYC). And a row's bits do not depend on what shares
the product: the same at every row count and position, on one thread or two, where MKL
gives the same bits only in multiples of 4 rows (loading/invariance.py measures whichever
runs).

`use_onednn` gives every plain float32 `nn.Linear` of a CPU model a forward through the
reordered weight. The layer stays an `nn.Linear` with its weight (packing, LoRA, the
fingerprint and tied embeddings read it), so the reordered copy is memory beside it: the
model's linear weights once more. Where the ops are missing (a torch built without
oneDNN) nothing changes.

oneDNN compiles a kernel per shape and caches it (about 0.55 MiB each, per layer shape and
row count, shared by the layers of one shape), and a step's row count varies with what it
prefills: one run of the CPU bench grew by 216 MiB so. Both of its caches (ideep's and
oneDNN's own) are capped at CACHE kernels unless the operator set them
(`LRU_CACHE_CAPACITY`, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`); a step with a new row count
compiles one kernel per layer shape (about 1 ms each), the next layers of that shape
reuse it. Splitting rows into a few fixed chunk sizes instead (no compiling) lost the gain
to the calls and the concatenation at these widths.

Layers with fewer than MIN_IN input features stay on MKL: at 256 the gain was 1.1x in one
call and less after a compile, at 384 and up 1.2-1.5x.

An encoder's intermediate block (BERT and its copies: `dense`, then an exact GELU) runs as
one oneDNN product with the GELU in its epilogue: no pass of its own over the
[tokens, intermediate] output, 5.5 % of the embedding bench's time (oneDNN's erf differs
from torch's by ~1e-6 relative). Its output blocks (`dense`, dropout, then LayerNorm of the
sum with the block's input) add the input in the product's epilogue: the same bits as the
eager sum, without a pass of its own over [tokens, hidden].
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# The row count the weight's layout is chosen for: a decode step's rows. Measured at 1 to
# 4,096 rows, a layout for 64 ran as fast as one for 4,096 (one for 1 row was slower).
_LAYOUT_ROWS = 64
_ATTR = "_onednn_weight"
MIN_IN = 384
CACHE = 32
_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def cap_caches() -> None:
    """Cap oneDNN's kernel caches (read once, at its first use: call before any)."""
    for name in _CACHES:
        os.environ.setdefault(name, str(CACHE))


def available() -> bool:
    mkldnn = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x, getattr(self, _ATTR), self.bias, "none", [], ""
    )
    return out


def _eligible(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and isinstance(weight, torch.Tensor)
        and type(weight.data) is torch.Tensor  # not a quantized tensor subclass
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[1] >= MIN_IN
    )


def _gelu_erf(act: Any) -> bool:
    """transformers' GELUActivation in its exact (erf) form, or torch's nn.GELU."""
    if type(act) is nn.GELU:
        return act.approximate == "none"
    return type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is F.gelu


# transformers' output blocks after attention and after the MLP (BERT and its copies).
_DENSE_ADD_NORM = [
    "hidden_states = self.dense(hidden_states)",
    "hidden_states = self.dropout(hidden_states)",
    "hidden_states = self.LayerNorm(hidden_states + input_tensor)",
    "return hidden_states",
]

# transformers' intermediate block, as its modelling files write it.
_DENSE_ACT = [
    "hidden_states = self.dense(hidden_states)",
    "hidden_states = self.intermediate_act_fn(hidden_states)",
    "return hidden_states",
]


def _is(module: nn.Module, body: list[str]) -> bool:
    """Whether `module`'s forward is these lines, its `dense` routed through oneDNN."""
    dense = getattr(module, "dense", None)
    if dense is None or _ATTR not in dense.__dict__ or "forward" in module.__dict__:
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    lines = [line.strip() for line in source.splitlines()[1:]]
    return [line for line in lines if line and not line.startswith("#")] == body


def _dense_then_act(module: nn.Module) -> bool:
    return _gelu_erf(getattr(module, "intermediate_act_fn", None)) and _is(module, _DENSE_ACT)


def _dense_add_norm(module: nn.Module) -> bool:
    norm = getattr(module, "LayerNorm", None)
    return isinstance(norm, nn.LayerNorm) and not module.training and _is(module, _DENSE_ADD_NORM)


def _dense_gelu(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    dense = self.dense
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        hidden_states, getattr(dense, _ATTR), dense.bias, "gelu", [], "none"
    )
    return out


def _dense_add_then_norm(
    self: Any, hidden_states: torch.Tensor, input_tensor: torch.Tensor
) -> torch.Tensor:
    # The residual added in the product's epilogue (after the bias, as the eager sum):
    # the same bits, without a pass of its own over the output.
    dense = self.dense
    summed = torch.ops.mkldnn._linear_pointwise.binary(
        hidden_states, input_tensor, getattr(dense, _ATTR), dense.bias, "add"
    )
    out: torch.Tensor = self.LayerNorm(summed)
    return out


@torch.no_grad()
def use_onednn(model: nn.Module) -> int:
    """Route `model`'s plain float32 CPU linear layers through oneDNN (call after packing:
    a packed projection is one layer); returns how many."""
    if not available():
        return 0
    cap_caches()
    done = 0
    for module in model.modules():
        if not _eligible(module) or _ATTR in module.__dict__:
            continue
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _LAYOUT_ROWS)
        except RuntimeError as exc:  # a shape or build oneDNN refuses: keep MKL
            log.debug("oneDNN linear unavailable for %s: %s", module, exc)
            continue
        module.__dict__[_ATTR] = packed
        module.forward = types.MethodType(_forward, module)
        done += 1
    for module in model.modules():
        if _dense_then_act(module):
            module.forward = types.MethodType(_dense_gelu, module)
        elif _dense_add_norm(module):
            module.forward = types.MethodType(_dense_add_then_norm, module)
    return done
