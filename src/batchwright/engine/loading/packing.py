"""Projections that read the same input, packed into one matmul.

An attention's q, k and v projections and an MLP's gate and up projections each read the
same hidden states: three and two matmuls a layer where one would do (on CUDA each is a
kernel launch, and a bigger matmul runs closer to the device's peak). `pack` replaces
them at load with one linear layer over their concatenated weights; where each stood, a
`Part` returns its columns of the packed output. The first part called computes the
whole product and the others take their share of it, as long as they are handed the
same tensor; anything else recomputes it, so a model that calls them on different
inputs still gets the right values. torch.compile traces the shared product once
(compiled.py). The weights are moved, not copied: memory stays what it was.

A gated MLP whose forward is transformers' usual one line (Llama, Mistral, Qwen and some
130 others) then multiplies in place, into its activation's output: the same values with
one [tokens, intermediate] tensor less. A 4,096-token prefill of the CPU bench's model
allocated 48 MiB there (36 now), the step's high-water mark, which the heap keeps. (The
activation itself stays out of place: written into the packed product's columns, it left
the down projection a strided input, 11 % slower in MKL at 4,096 rows.)
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

# Sibling projections reading one input, in the order their outputs are packed.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Packed(nn.Module):
    """The packed linear layer and the one product its parts share."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        out = sum(lin.out_features for lin in linears)
        self.proj = nn.Linear(
            first.in_features,
            out,
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        with torch.no_grad():
            self.proj.weight.copy_(torch.cat([lin.weight for lin in linears]))
            if self.proj.bias is not None:
                self.proj.bias.copy_(torch.cat([lin.bias for lin in linears]))
        self.parts = len(linears)
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._left = 0

    def take(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self._left == 0 or self._x is not x:
            self._x, self._y, self._left = x, self.proj(x), self.parts
        y = self._y
        assert y is not None
        self._left -= 1
        if self._left == 0:  # every part has its share: hold nothing between forwards
            self._x = self._y = None
        return y[..., start:end]


class Part(nn.Module):
    """Stands where one projection stood: its columns of the packed product."""

    packed: Packed

    def __init__(self, packed: Packed, start: int, end: int) -> None:
        super().__init__()
        # Not a submodule: the packed layer is registered once, on the parent.
        self.__dict__["packed"] = packed
        self.start, self.end = start, end
        self.in_features = packed.proj.in_features
        self.out_features = end - start

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.proj.weight[self.start : self.end]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.packed.proj.bias
        return None if bias is None else bias[self.start : self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.packed.take(x, self.start, self.end)
        return out


def _plain(weight: Any) -> bool:
    """A dense weight: not one of a quantized checkpoint's tensor subclasses (torchao,
    bitsandbytes, ...), whose layers stay as transformers loaded them."""
    return type(weight) in (torch.Tensor, nn.Parameter) and type(weight.data) is torch.Tensor


def _packable(linears: list[Any]) -> bool:
    if not all(type(lin) is nn.Linear and _plain(lin.weight) for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and (lin.bias is None) == (first.bias is None)
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        for lin in linears
    )


# transformers' gated MLP forward, as its modelling files write it (one of these bodies).
_GATED = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
_GATED_BODIES = ([f"down_proj = {_GATED}", "return down_proj"], [f"return {_GATED}"])


def _gated_mlp(module: nn.Module) -> bool:
    """Whether `module` is a gated MLP with transformers' one-line forward."""
    if not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    lines = [line.strip() for line in source.splitlines()]
    body = [line for line in lines[1:] if line and not line.startswith("#")]
    return lines[0].startswith("def forward(self, x)") and body in _GATED_BODIES


# A CPU prefill's MLP runs this many tokens at a time: a multiple of every GEMM row
# multiple batch invariance may find (loading/invariance.py), so each row's bits are the
# unsplit product's, and large enough that MKL runs at its full speed.
MLP_CHUNK = 960


def _per_token(layer: nn.Module) -> bool:
    """A projection that reads each token on its own. A layer wrapping one says so itself
    (`per_token`: a LoRA layer's adapters are indexed by the forward's tokens, so a
    forward with adapter rows is never split)."""
    if type(layer) is Part:
        layer = layer.packed.proj
    return type(layer) is nn.Linear or getattr(layer, "per_token", False) is True


def _gated(self: Any, x: torch.Tensor) -> torch.Tensor:
    h: torch.Tensor = self.act_fn(self.gate_proj(x))
    out: torch.Tensor = self.down_proj(h.mul_(self.up_proj(x)))
    return out


def _gated_in_place(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, the product written into the
    activation's output; on CPU a long input MLP_CHUNK tokens at a time, so the
    [tokens, 2 x intermediate] product of a whole prefill is never held at once."""
    tokens = x.shape[-2] if x.dim() >= 2 else 0
    if (
        tokens <= MLP_CHUNK
        or x.device.type != "cpu"
        or not all(_per_token(getattr(self, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    ):
        return _gated(self, x)
    parts = [_gated(self, x[..., s : s + MLP_CHUNK, :]) for s in range(0, tokens, MLP_CHUNK)]
    return torch.cat(parts, dim=-2)


def pack(model: nn.Module) -> int:
    """Pack every group of sibling projections in `model`, and run its gated MLPs in
    place; returns how many groups were packed."""
    done = 0
    for module in list(model.modules()):
        if _gated_mlp(module):
            module.forward = types.MethodType(_gated_in_place, module)
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not _packable(linears):
                continue
            packed = Packed(linears)  # type: ignore[arg-type]
            module.add_module("packed_" + "_".join(n.split("_")[0] for n in names), packed)
            start = 0
            for name, lin in zip(names, linears, strict=True):
                end = start + lin.out_features  # type: ignore[union-attr]
                setattr(module, name, Part(packed, start, end))
                start = end
            done += 1
    return done
