"""Tiny random-weight embedding models in sentence-transformers' layout, built offline.

`build_encoder` writes a BERT-style encoder (WordPiece, [CLS] ... [SEP]), `build_decoder`
a Qwen3-style decoder embedding model (byte-level BPE, EOS appended, last-token pooling):
the weights (`save_pretrained` of the model without a head), the tokenizer, and the
sentence-transformers files (modules.json, sentence_bert_config.json, 1_Pooling/,
config_sentence_transformers.json) as sentence-transformers writes them. Tests load them
with sentence-transformers for the reference vectors and with the engine; benches use them
as models of any size. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

from batchwright.engine.loading.demo import EOS_TOKEN, _corpus_lines, build_tokenizer

_BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=_BERT_SPECIAL, show_progress=False
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _decoder_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The demo's byte-level BPE with EOS appended to every input (Qwen3-Embedding's
    tokenizer does the same: its last-token pooling reads the EOS)."""
    base = build_tokenizer(vocab_size)
    tok = base.backend_tokenizer
    eos = tok.token_to_id(EOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B:1 {EOS_TOKEN}:1",
        special_tokens=[(EOS_TOKEN, eos)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="left",
    )


def _st_files(
    out: Path,
    *,
    dim: int,
    pooling: str,
    normalize: bool,
    max_seq_length: int,
    prompts: dict[str, str] | None,
    default_prompt: str | None,
    include_prompt: bool,
) -> None:
    st = "sentence_transformers.models."
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": st + "Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": st + "Normalize",
            }
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "cls": "pooling_mode_cls_token",
        "mean": "pooling_mode_mean_tokens",
        "max": "pooling_mode_max_tokens",
        "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
        "weightedmean": "pooling_mode_weightedmean_tokens",
        "lasttoken": "pooling_mode_lasttoken",
    }
    pool = {"word_embedding_dimension": dim, **{f: f == flags[pooling] for f in flags.values()}}
    pool["include_prompt"] = include_prompt
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": prompts or {},
                "default_prompt_name": default_prompt,
                "similarity_fn_name": "cosine",
            },
            indent=2,
        )
    )


def build_encoder(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = 1000,
    max_position_embeddings: int = 512,
    pooling: str = "mean",
    normalize: bool = True,
    matryoshka: list[int] | None = None,
    prompts: dict[str, str] | None = None,
    default_prompt: str | None = None,
    include_prompt: bool = True,
    seed: int = 0,
) -> Path:
    """A random BertModel with a WordPiece tokenizer, in sentence-transformers' layout."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _bert_tokenizer(vocab_size)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate_size or hidden_size * 4,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=int(tokenizer.pad_token_id),
    )
    if matryoshka:
        config.matryoshka_dimensions = matryoshka
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config, add_pooling_layer=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _st_files(
        out,
        dim=hidden_size,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_position_embeddings,
        prompts=prompts,
        default_prompt=default_prompt,
        include_prompt=include_prompt,
    )
    return out


def build_decoder(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 1000,
    max_position_embeddings: int = 512,
    pooling: str = "lasttoken",
    normalize: bool = True,
    matryoshka: list[int] | None = None,
    prompts: dict[str, str] | None = None,
    default_prompt: str | None = None,
    include_prompt: bool = True,
    seed: int = 0,
) -> Path:
    """A random Qwen3Model (causal, grouped-query attention, q/k norms) with an
    EOS-appending byte-level BPE tokenizer, in sentence-transformers' layout."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _decoder_tokenizer(vocab_size)
    eos = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    if matryoshka:
        config.matryoshka_dimensions = matryoshka
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3Model(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _st_files(
        out,
        dim=hidden_size,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_position_embeddings,
        prompts=prompts,
        default_prompt=default_prompt,
        include_prompt=include_prompt,
    )
    return out
