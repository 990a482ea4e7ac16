"""Linear layers that add each token's adapter delta to the base's product.

`wrap` replaces, once at load, every linear layer inside the decoder layers with a
`LoraLinear` around it; a packed projection (engine/loading/packing.py) is wrapped as one layer
whose output columns are its parts' (q, k, v or gate, up): its adapters' A matrices are
stacked side by side, so one product shrinks the input for all parts, and each part's B
expands into its own columns. With no adapter row in a step the layer is the base layer
plus one attribute check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import nn

from batchwright.engine.loading.packing import Packed, Part


class Kernel(Protocol):
    """A step's way of adding deltas (kernels.py)."""

    def apply(self, layer: LoraLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class LoraState:
    """Shared by every LoraLinear of a model: what the current forward adds.

    `kernel` is None when no row of the forward has an adapter. The dense kernel reads
    only tensors that live as long as the model (`index`, the slot stacks), so a
    compiled forward and a captured graph read it too; the step writes `index` before
    the forward runs."""

    kernel: Kernel | None = None
    dense: bool = False
    index: torch.Tensor | None = None  # dense: slot + 1 of each token (0: base), long-lived
    slot_ids: torch.Tensor | None = None  # dense: 1..max_loras


@dataclass(eq=False)
class Slice:
    """One part of a layer's output: the PEFT module name it answers to and its columns."""

    name: str
    start: int
    end: int


class LoraLinear(nn.Module):
    """`base(x)` plus each token's delta; the slot stacks (slots.py) hold the adapters:
    `a` [slots, parts * rank, in] and per part `b[i]` [slots, rank, out_i] (scaled)."""

    state: LoraState

    def __init__(self, base: nn.Module, slices: list[Slice], state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.in_features = int(base.in_features)  # type: ignore[arg-type]
        self.out_features = int(base.out_features)  # type: ignore[arg-type]
        self.__dict__["state"] = state  # shared, not a submodule
        # Dense layout: A [slots, parts * rank, in], per part B [slots, rank, out_i].
        self.a: torch.Tensor | None = None
        self.b: list[torch.Tensor] = []
        # Grouped layout: A transposed [slots, in, parts * rank], B block-diagonal
        # [slots, parts * rank, out] (a part's rows feed only its own columns).
        self.at: torch.Tensor | None = None
        self.bd: torch.Tensor | None = None
        self.rank = 0  # the stacks' rank (max_lora_rank) once allocated
        # Per slot: the parts its adapter targets (empty: the slot adds nothing here).
        self.targeted: list[frozenset[int]] = []

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.base.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        return cast(torch.Tensor | None, self.base.bias)

    @property
    def per_token(self) -> bool:
        """Whether this forward reads each token on its own (no adapter row in it), so a
        caller may split its tokens (loading/packing.py's MLP chunks)."""
        return self.state.kernel is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cast(torch.Tensor, self.base(x))
        kernel = self.state.kernel
        if kernel is None:
            return y
        return kernel.apply(self, x, y)


@dataclass
class Wrapped:
    """The wrapped layers of a model and where each PEFT module name lands."""

    state: LoraState
    layers: list[LoraLinear] = field(default_factory=list)
    # PEFT module name (model.layers.0.self_attn.q_proj) -> (layer, part index)
    targets: dict[str, tuple[LoraLinear, int]] = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every adaptable module, by PEFT module name."""
        return {
            name: (layer.in_features, layer.slices[i].end - layer.slices[i].start)
            for name, (layer, i) in self.targets.items()
        }


def _in_decoder_layer(name: str) -> bool:
    parts = name.split(".")
    return any(
        p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts)
    )


def wrap(model: nn.Module) -> Wrapped:
    """Wrap every linear layer of the decoder layers (after packing) in a LoraLinear."""
    out = Wrapped(LoraState())
    for parent_name, parent in list(model.named_modules()):
        if not _in_decoder_layer(parent_name + "."):
            continue
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}"
            if isinstance(child, Packed):
                parts = [
                    (n, p)
                    for n, p in parent.named_children()
                    if isinstance(p, Part) and p.packed is child
                ]
                slices = [Slice(f"{parent_name}.{n}", p.start, p.end) for n, p in parts]
                layer = LoraLinear(child.proj, slices, out.state)
                child.proj = layer  # type: ignore[assignment]
            elif type(child) is nn.Linear:
                layer = LoraLinear(child, [Slice(full, 0, child.out_features)], out.state)
                setattr(parent, child_name, layer)
            else:
                continue
            out.layers.append(layer)
            for i, s in enumerate(layer.slices):
                out.targets[s.name] = (layer, i)
    return out


def flat(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and output as [tokens, features] views (the forward's token order)."""
    return x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
