"""An adapter's weights, read from its PEFT folder and checked against the wrapped model."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from batchwright.adapter_files import WEIGHTS, AdapterError, AdapterInfo, describe


@dataclass(eq=False)
class AdapterWeights:
    """name, the key its KV and slot are known by (name and content), and per adapted
    module (PEFT module name) A [r, in], B [out, r] and the scaling, on the host."""

    name: str
    info: AdapterInfo
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    _on: dict[tuple[str, str], dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = field(
        default_factory=dict
    )

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.info.digest)

    @property
    def rank(self) -> int:
        return self.info.rank

    def fingerprint(self, base: str) -> str:
        """The system_fingerprint of the adapter's results: the base's and the adapter's."""
        return "fp_" + hashlib.sha256(f"{base}:{self.info.digest}".encode()).hexdigest()[:10]

    def on(
        self, device: torch.device, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """The tensors on the model's device and dtype (kept: echo scoring reuses them)."""
        key = (str(device), str(dtype))
        if key not in self._on:
            self._on[key] = {
                m: (a.to(device, dtype), b.to(device, dtype), s)
                for m, (a, b, s) in self.tensors.items()
            }
        return self._on[key]


def load_adapter(
    name: str, folder: Path, shapes: dict[str, tuple[int, int]], max_rank: int
) -> AdapterWeights:
    """Read and check an adapter for a model whose adaptable modules have `shapes`
    ((in, out) by PEFT module name, layers.Wrapped.shapes)."""
    info = describe(folder)
    if info.rank > max_rank:
        raise AdapterError(
            f"adapter {name!r}: rank {info.rank} is above the base's max_lora_rank {max_rank}"
        )
    for module, t in info.targets.items():
        shape = shapes.get(module)
        if shape is None:
            raise AdapterError(
                f"adapter {name!r}: target module {module} is not a linear layer of the base"
            )
        if shape != (t.in_features, t.out_features):
            raise AdapterError(
                f"adapter {name!r}: {module} is {t.in_features}->{t.out_features} in the "
                f"adapter but {shape[0]}->{shape[1]} in the base: trained for another base"
            )
    raw = load_file(str(Path(folder) / WEIGHTS))
    tensors = {
        m: (raw[t.a_key].float(), raw[t.b_key].float(), t.scaling) for m, t in info.targets.items()
    }
    return AdapterWeights(name, info, tensors)
