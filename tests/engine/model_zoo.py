"""Tiny random models of many architectures, built from transformers' own config classes
with the demo tokenizer and loaded through the real loading path (tests/engine/
test_models.py, bench/models_bench.py, docs/models.md).

Every model has hidden size 64 and two layers; weights are initialised wide (a standard
deviation of 0.2 where the config takes one) so greedy decoding has no near-ties.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as tr

from batchwright.engine.loading.demo import EOS_TOKEN, build_tokenizer

_TOKENIZER = build_tokenizer(1000)
VOCAB = len(_TOKENIZER)
EOS = int(_TOKENIZER.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]


def _common(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": EOS,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    }
    base.update(over)
    return base


_LAYERS = ["sliding_attention", "full_attention"]

# name -> (config, what the case shows)
ZOO: dict[str, tuple[Callable[[], Any], str]] = {
    "llama": (lambda: tr.LlamaConfig(**_common()), "grouped-query attention"),
    "qwen2": (lambda: tr.Qwen2Config(**_common()), "q/k/v biases"),
    "qwen2_window16": (
        lambda: tr.Qwen2Config(
            **_common(use_sliding_window=True, sliding_window=16, max_window_layers=1)
        ),
        "use_sliding_window with max_window_layers 1: window 16 on the second layer only",
    ),
    "qwen3": (lambda: tr.Qwen3Config(**_common(head_dim=16)), "q/k norms"),
    "qwen3_moe": (
        lambda: tr.Qwen3MoeConfig(
            **_common(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        ),
        "mixture of experts",
    ),
    "mistral": (lambda: tr.MistralConfig(**_common(sliding_window=None)), "no window"),
    "mistral_window16": (
        lambda: tr.MistralConfig(**_common(sliding_window=16)),
        "a sliding window of 16 on every layer (binds)",
    ),
    "mistral_window4096": (
        lambda: tr.MistralConfig(**_common(sliding_window=4096)),
        "window 4096 on a 512-token context (never binds: full attention)",
    ),
    "mixtral": (
        lambda: tr.MixtralConfig(
            **_common(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
        ),
        "mixture of experts",
    ),
    "gemma": (lambda: tr.GemmaConfig(**_common(head_dim=16)), "scaled embeddings"),
    "gemma2": (
        lambda: tr.Gemma2Config(**_common(head_dim=16, sliding_window=16, layer_types=_LAYERS)),
        "window 16 on alternate layers, attention and final logit soft-capping",
    ),
    "gemma3": (
        lambda: tr.Gemma3TextConfig(**_common(head_dim=16, sliding_window=16, layer_types=_LAYERS)),
        "window 16 on alternate layers, a RoPE base per layer kind, q/k norms",
    ),
    "phi3": (
        lambda: tr.Phi3Config(**_common(sliding_window=2047)),
        "window 2047 on a 512-token context (never binds)",
    ),
    "phi": (lambda: tr.PhiConfig(**_common(num_key_value_heads=4)), "partial rotary"),
    "gpt2": (
        lambda: tr.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=EOS,
            eos_token_id=EOS,
            initializer_range=0.2,
        ),
        "learned positions",
    ),
    "gpt_neox": (lambda: tr.GPTNeoXConfig(**_common(num_key_value_heads=4)), "parallel residual"),
    "opt": (
        lambda: tr.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
            bos_token_id=EOS,
            eos_token_id=EOS,
            pad_token_id=EOS,
            init_std=0.2,
        ),
        "learned positions (offset 2)",
    ),
    "falcon_multi_query": (
        lambda: tr.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            alibi=False,
            parallel_attn=True,
            bias=False,
            bos_token_id=EOS,
            eos_token_id=EOS,
            initializer_range=0.2,
            max_position_embeddings=512,
        ),
        "one KV head (multi_query, as Falcon-7B)",
    ),
    "falcon_new_arch": (
        lambda: tr.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            alibi=False,
            bias=False,
            bos_token_id=EOS,
            eos_token_id=EOS,
            initializer_range=0.2,
            max_position_embeddings=512,
        ),
        "new decoder architecture, 2 KV heads",
    ),
    "gpt_neo": (
        lambda: tr.GPTNeoConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=16,
            bos_token_id=EOS,
            eos_token_id=EOS,
            initializer_range=0.2,
            max_position_embeddings=512,
        ),
        "no attention interface (transformers' own), a local layer of window 16",
    ),
    "stablelm": (lambda: tr.StableLmConfig(**_common()), "partial rotary, layer norm"),
    "olmo": (lambda: tr.OlmoConfig(**_common()), "non-parametric layer norm"),
    "olmo2": (lambda: tr.Olmo2Config(**_common()), "q/k norms after projection"),
    "granite": (
        lambda: tr.GraniteConfig(**_common(attention_multiplier=0.2, logits_scaling=2.0)),
        "the model's own attention scaling and logit scaling",
    ),
    # logit_scale 1 (default 1/16): wide margins between the best tokens.
    "cohere": (lambda: tr.CohereConfig(**_common(logit_scale=1.0)), "parallel block"),
    "cohere2": (
        lambda: tr.Cohere2Config(
            **_common(sliding_window=16, layer_types=_LAYERS, logit_scale=1.0)
        ),
        "window 16 on alternate layers, no positions on full layers",
    ),
    "smollm3": (
        lambda: tr.SmolLM3Config(**_common(no_rope_layers=[1, 0])),
        "a layer without positional encoding",
    ),
    "gpt_oss": (
        lambda: tr.GptOssConfig(
            **_common(
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=16,
                layer_types=_LAYERS,
            )
        ),
        "attention sinks, window 16 on alternate layers, mixture of experts",
    ),
    "deepseek_v3": (
        lambda: tr.DeepseekV3Config(
            **_common(
                num_key_value_heads=4,
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=12,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
            )
        ),
        "multi-head latent attention: keys 16 wide, values 12",
    ),
    "glm4": (lambda: tr.Glm4Config(**_common(head_dim=16)), "partial rotary, extra norms"),
}


def build(name: str, root: Path, seed: int = 0) -> Path:
    """Write the zoo model `name` (HF format, with the tokenizer) under `root`."""
    out = root / name
    if (out / "config.json").exists():
        return out
    config = ZOO[name][0]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tr.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    _TOKENIZER.save_pretrained(out)
    return out
