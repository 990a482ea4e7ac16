"""A quantized checkpoint (torchao int8 weight-only, which runs on CPU) runs as transformers
loads it: packing steps aside for its layers, the weights stay int8 in memory, and greedy
text and logprobs equal HF generate of the same quantized model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, TorchAoConfig

from batchwright.engine.engine import Engine
from tests.engine.model_zoo import _TOKENIZER, build
from tests.engine.test_models import compare, engine_greedy, hf_greedy, spec

torchao = pytest.importorskip("torchao")


def _bytes(model: Any) -> int:
    """Bytes the model's linear weights hold, a quantized tensor's inner tensors counted."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            if hasattr(w, "__tensor_flatten__"):
                names, _ = w.__tensor_flatten__()
                total += sum(getattr(w, n).nbytes for n in names)
            else:
                total += w.nbytes
    return total


def test_int8_weight_only_checkpoint_matches_hf_and_stays_small(tmp_path: Path) -> None:
    from torchao.quantization import Int8WeightOnlyConfig

    dense = build("llama", tmp_path)
    config = TorchAoConfig(Int8WeightOnlyConfig())
    quantized = AutoModelForCausalLM.from_pretrained(
        dense, dtype=torch.float32, quantization_config=config
    )
    path = tmp_path / "llama_int8"
    quantized.save_pretrained(path, safe_serialization=True)
    _TOKENIZER.save_pretrained(path)

    engine = Engine.load(spec(path))  # packing once crashed here on aten.cat of int8 weights
    plain = Engine.load(spec(dense))
    q_proj = engine.lm.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.weight).__name__ == "Int8Tensor"
    # int8 weights and a scale per row: about a quarter of the float32 weights (the
    # decoder layers; transformers leaves the output layer in float32).
    assert _bytes(engine.lm.model.model.layers) < 0.35 * _bytes(plain.lm.model.model.layers)
    want, margin = hf_greedy(path)  # HF loads it quantized, from its quantization_config
    assert margin > 1e-3
    compare(engine, want)

    # A worker imports the engine first: transformers then comes up without torchao or
    # scipy (engine/platform/lazy_imports.py); the checkpoint imports torchao as it loads,
    # and the losses' matching (scipy's) still answers when called.
    script = f"""
import json, sys
from batchwright.engine.engine import Engine
from tests.engine.test_models import engine_greedy, spec
before = "torchao" in sys.modules
engine = Engine.load(spec({str(path)!r}))
after, scipy = "torchao" in sys.modules, "scipy" in sys.modules
from transformers.loss.loss_rt_detr import linear_sum_assignment
rows, cols = linear_sum_assignment([[4.0, 1.0], [2.0, 8.0]])
print(json.dumps({{"before": before, "after": after, "scipy": scipy,
    "matching": [rows.tolist(), cols.tolist()], "greedy": engine_greedy(engine)}}))
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["before"], got["after"], got["scipy"]) == (False, True, False)
    assert got["matching"] == [[0, 1], [1, 0]]
    assert [text for text, _ in got["greedy"]] == [text for text, _ in engine_greedy(engine)]
