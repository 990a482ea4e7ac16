"""Models the engine cannot serve right are refused at load, in one line; a model whose
RoPE scaling would make rows depend on each other is served where it cannot (below the
length it switches at) and refused past it; `batchwright run` refuses before any state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tr

from batchwright.engine.engine import Engine
from batchwright.engine.loading.loader import load_model
from batchwright.engine.requests.types import ModelRefused
from batchwright.registry import ModelSpec
from tests.engine.model_zoo import _TOKENIZER, EOS, VOCAB
from tests.engine.test_models import compare, hf_greedy


def _save(config: tr.PretrainedConfig, cls: type, path: Path) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cls(config).save_pretrained(path)
    _TOKENIZER.save_pretrained(path)
    return path


def _spec(path: Path, **over: object) -> ModelSpec:
    return ModelSpec(name="m", path=path, device="cpu", max_rows=4, **over)  # type: ignore[arg-type]


def _bert() -> tr.BertConfig:
    return tr.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        pad_token_id=EOS,
        initializer_range=0.2,
    )


def test_an_encoder_that_the_causal_auto_class_accepts_is_refused(tmp_path: Path) -> None:
    # AutoModelForCausalLM takes a BertForMaskedLM checkpoint (as BertLMHeadModel) and
    # would run it: its attention looks ahead.
    path = _save(_bert(), tr.BertForMaskedLM, tmp_path / "bert")
    with pytest.raises(ModelRefused, match="not a causal decoder") as err:
        load_model(_spec(path))
    assert "\n" not in str(err.value) and "Bert" in str(err.value)


def test_a_checkpoint_without_the_head_is_refused(tmp_path: Path) -> None:
    # transformers would initialise the LM head at random and warn.
    path = _save(_bert(), tr.BertModel, tmp_path / "bare")
    with pytest.raises(ModelRefused, match="lacks weights") as err:
        load_model(_spec(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (tr.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2), "Mamba"),
        (
            tr.Lfm2Config(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["conv", "full_attention"],
            ),
            "conv",
        ),
    ],
)
def test_layers_that_are_not_attention_are_refused_by_kind(
    tmp_path: Path, config: tr.PretrainedConfig, kind: str
) -> None:
    # Refused from the config, before any weight is read: no weights are written here.
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelRefused, match=kind) as err:
        load_model(_spec(tmp_path))
    assert "\n" not in str(err.value)


def _dynamic(path: Path) -> Path:
    config = tr.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
        bos_token_id=EOS,
        eos_token_id=EOS,
        initializer_range=0.2,
    )
    return _save(config, tr.LlamaForCausalLM, path)


def test_dynamic_rope_is_served_below_its_switch_and_refused_past_it(tmp_path: Path) -> None:
    # transformers scales dynamic RoPE by the longest position in the whole forward: past
    # max_position_embeddings a row's text would depend on the rows packed beside it.
    path = _dynamic(tmp_path / "dynamic")
    with pytest.raises(ModelRefused, match="context_length to at most 64"):
        load_model(_spec(path, context_length=512))
    engine = Engine.load(_spec(path))
    assert engine.lm.context_length == 64
    want, _ = hf_greedy(path)
    compare(engine, want)


def test_batchwright_run_refuses_in_one_line_before_any_state(tmp_path: Path) -> None:
    model = _save(_bert(), tr.BertForMaskedLM, tmp_path / "bert")
    home = tmp_path / "home"
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "bert", "prompt": "hello", "max_tokens": 2},
    }
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(line) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env["BATCHWRIGHT_HOME"] = str(home)
    env["BATCHWRIGHT_MODELS"] = json.dumps({"models": {"bert": {"path": str(model)}}})
    done = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "run", str(data), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not a causal decoder" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())
    assert not (tmp_path / "in.output.jsonl").exists()
