"""q/k/v and gate/up projections packed into one matmul each (engine/packing.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from batchwright.engine.loading import packing
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.loading.invariance import rows_multiple
from batchwright.engine.loading.packing import pack

_MATMULS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}


class _Matmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in _MATMULS:
            self.seen[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_packed_projections_give_the_same_logits_in_four_matmuls(
    engine: Any, tmp_path: Path
) -> None:
    # The engine's model is packed at load: a layer's matmuls are qkv, o, gate-up and
    # down, and the logits are the unpacked model's (a grouped-query model here).
    path = build_demo_model(tmp_path / "gqa", kv_heads=2)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = plain.config.num_hidden_layers
    assert pack(packed) == 2 * layers
    ids = torch.randint(3, plain.config.vocab_size, (2, 17))
    counts = _Matmuls()
    with counts:
        got = packed(input_ids=ids, use_cache=False).logits
    want = plain(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert sum(counts.seen.values()) == 4 * layers + 1  # + the output layer
    # Nothing of a forward stays held between forwards.
    assert all(m._x is None and m._y is None for m in packed.modules() if hasattr(m, "_left"))
    # The engine loads its model packed.
    engine_layers = engine.lm.model.config.num_hidden_layers
    assert sum(type(m).__name__ == "Packed" for m in engine.lm.model.modules()) == 2 * engine_layers


@torch.no_grad()
def test_a_long_input_runs_the_mlp_in_chunks_with_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prefill longer than MLP_CHUNK runs its gated MLPs a chunk of tokens at a time (the
    # [tokens, 2 x intermediate] product of the whole prompt is never held): the logits are
    # the unpacked model's, and bit for bit the unsplit ones where batch invariance holds
    # for the chunks' row counts.
    path = build_demo_model(tmp_path / "m", kv_heads=2)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pack(packed)
    layers = packed.config.num_hidden_layers
    ids = torch.randint(3, plain.config.vocab_size, (1, 3 * 48 + 24))
    whole = packed(input_ids=ids, use_cache=False).logits
    monkeypatch.setattr(packing, "MLP_CHUNK", 48)
    counts = _Matmuls()
    with counts:
        got = packed(input_ids=ids, use_cache=False).logits
    # Per layer: qkv and o once, gate-up and down once per chunk (4 chunks).
    assert sum(counts.seen.values()) == (2 + 2 * 4) * layers + 1
    assert torch.allclose(got, plain(input_ids=ids, use_cache=False).logits, atol=1e-5)
    multiple = rows_multiple(packed)
    if multiple is not None and 48 % multiple == 0 and 24 % multiple == 0:
        assert torch.equal(got, whole)
