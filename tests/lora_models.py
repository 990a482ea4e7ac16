"""Tiny LoRA adapters made with PEFT for a tiny base, and PEFT's own answers as the oracle.

Adapters are random (`init_lora_weights=False`: B is not zero, so each adapter changes the
base's text) and saved as PEFT saves them: adapter_config.json and
adapter_model.safetensors, no tokenizer. Nothing downloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ATTENTION + MLP

# Three adapters of different ranks and targets (and one with rsLoRA and a rank pattern).
SPECS: dict[str, dict[str, Any]] = {
    "attn-r8": {"r": 8, "targets": ATTENTION, "alpha": 16, "seed": 1},
    "mlp-r4": {"r": 4, "targets": MLP, "alpha": 8, "seed": 2},
    "all-r16": {
        "r": 16,
        "targets": ALL,
        "alpha": 8,
        "seed": 3,
        "rslora": True,
        "rank_pattern": {"v_proj": 4},
    },
}


def build_adapter(
    base: Path,
    out: Path,
    *,
    r: int,
    targets: Sequence[str],
    alpha: float,
    seed: int,
    rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
) -> Path:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=rslora,
        rank_pattern=rank_pattern or {},
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def build_adapters(
    base: Path, root: Path, specs: dict[str, dict[str, Any]] | None = None
) -> dict[str, Path]:
    out = {}
    for name, spec in (specs or SPECS).items():
        spec = dict(spec)
        out[name] = build_adapter(base, root / name, targets=spec.pop("targets"), **spec)
    return out


class PeftOracle:
    """The base with every adapter loaded in PEFT; `adapter_names` picks one per row."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        names = list(adapters)
        peft_model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            peft_model.load_adapter(adapters[name], adapter_name=name)
        peft_model.eval()
        self.model = peft_model

    @torch.no_grad()
    def logits(self, rows: Sequence[Sequence[int]], names: Sequence[str | None]) -> torch.Tensor:
        """Logits [rows, len, vocab] of equal-length rows, each under its adapter (None:
        the base), in one mixed batch."""
        ids = torch.tensor([list(r) for r in rows])
        adapter_names = [n if n is not None else "__base__" for n in names]
        out = self.model(input_ids=ids, adapter_names=adapter_names, use_cache=False)
        return out.logits.float()

    @torch.no_grad()
    def greedy(self, ids: Sequence[int], steps: int, name: str | None, eos: set[int]) -> list[int]:
        out: list[int] = []
        for _ in range(steps):
            logits = self.logits([[*ids, *out]], [name])[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt in eos:
                break
        return out

    @torch.no_grad()
    def logprobs(self, ids: Sequence[int], name: str | None) -> torch.Tensor:
        return torch.log_softmax(self.logits([ids], [name])[0], dim=-1)
