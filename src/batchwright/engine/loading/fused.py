"""transformers' RMSNorm and rotary embedding as one native pass each on CPU (float32).

Eager, Llama's RMSNorm is six ops (a cast, a square, a mean, an add, an rsqrt, two
products) and `apply_rotary_pos_emb` ten (products, halves negated and concatenated,
sums) for the queries and the keys: each op a tensor and a dispatch, on the small tensors
of a decode step. On the compute-bound bench model (hidden 512, 8 layers) they and the
module calls around them were 16 % of a step; the kernels (platform/csrc/elementwise.h)
do each in one pass. The rotary's bits are transformers'; the RMSNorm's mean of squares
adds in another order (docs/engine.md).

What is replaced is found by its source: an RMSNorm module whose forward is Llama's lines
(Qwen, Mistral and the other copies), and a modelling module's `apply_rotary_pos_emb`
whose body is Llama's, with its `rotate_half`. Anything else (Gemma's 1 + weight, partial
rotary, other dtypes or devices at call time, a forward torch.compile traces) keeps
transformers' code.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from batchwright.engine.platform import native

log = logging.getLogger(__name__)

_RMS_BODY = [
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
    "return self.weight * hidden_states.to(input_dtype)",
]
_ROTARY_BODY = [
    "cos = cos.unsqueeze(unsqueeze_dim)",
    "sin = sin.unsqueeze(unsqueeze_dim)",
    "q_embed = (q * cos) + (rotate_half(q) * sin)",
    "k_embed = (k * cos) + (rotate_half(k) * sin)",
    "return q_embed, k_embed",
]
_ROTATE_HALF_BODY = [
    "x1 = x[..., : x.shape[-1] // 2]",
    "x2 = x[..., x.shape[-1] // 2 :]",
    "return torch.cat((-x2, x1), dim=-1)",
]


def _body(fn: Any) -> list[str] | None:
    """The statements of `fn` (docstring, comments and decorators left out)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    lines = [line.strip() for line in source.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
    if start is None:
        return None
    body, quoted = [], False
    for line in lines[start + 1 :]:
        if line.startswith(('"""', "'''")):
            quoted = not quoted if line.count(line[:3]) == 1 else quoted
            continue
        if quoted or not line or line.startswith("#"):
            continue
        body.append(line)
    return body


def _unwrapped(fn: Any) -> Any:
    """A function the `kernels` hub integration wrapped in a module: the function."""
    forward = getattr(type(fn), "forward", None)
    closure = getattr(forward, "__closure__", None) or ()
    names = getattr(getattr(forward, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, closure, strict=False):
        if name == "func":
            return cell.cell_contents
    return fn


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.device.type != "cpu" or hidden_states.dtype != torch.float32:
        out: torch.Tensor = type(self).forward(self, hidden_states)
        return out
    normed: torch.Tensor = native.module().rms_norm(  # type: ignore[union-attr]
        hidden_states, self.weight, float(self.variance_epsilon)
    )
    return normed


def _rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    kernel = native.module().rotary_embed  # type: ignore[union-attr]

    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> Any:
        if (
            unsqueeze_dim != 1
            or torch.compiler.is_compiling()
            or q.device.type != "cpu"
            or not all(t.dtype == torch.float32 for t in (q, k, cos, sin))
            or q.dim() != 4
            or cos.dim() != 3
        ):
            return original(q, k, cos, sin, unsqueeze_dim)
        q_embed, k_embed = kernel(q, k, cos, sin)
        return q_embed, k_embed

    apply_rotary_pos_emb.batchwright_fused = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def use_fused(model: nn.Module) -> tuple[int, int]:
    """Route `model`'s RMSNorms and its modelling modules' rotary through the kernels;
    returns (RMSNorm modules, modelling modules) replaced. Nothing where the CPU extension
    is not built."""
    if native.module() is None:
        return 0, 0
    norms, modules = 0, set()
    for module in model.modules():
        if (
            "forward" not in module.__dict__
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and hasattr(module, "variance_epsilon")
            and _body(type(module).forward) == _RMS_BODY
        ):
            module.forward = types.MethodType(_rms_forward, module)
            norms += 1
        modules.add(type(module).__module__)
    rotaries = 0
    for name in sorted(modules):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, "batchwright_fused", False):
            continue
        original = _unwrapped(fn)
        half = getattr(mod, "rotate_half", None)
        if _body(original) == _ROTARY_BODY and _body(half) == _ROTATE_HALF_BODY:
            mod.apply_rotary_pos_emb = _rotary(original)  # type: ignore[union-attr]
            rotaries += 1
    return norms, rotaries
