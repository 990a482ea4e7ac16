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
"""

from __future__ import annotations

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


def pack(model: nn.Module) -> int:
    """Pack every group of sibling projections in `model`; returns how many groups."""
    done = 0
    for module in list(model.modules()):
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
