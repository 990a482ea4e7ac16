"""An embedding model loaded for the engine: the transformer without a head (`AutoModel`),
its tokenizer, and what its sentence-transformers files say (config.py).

Encoders (BERT, RoBERTa, XLM-RoBERTa …) attend both ways, decoder embedding models
(Qwen3-Embedding, e5-mistral style) causally: the model's own attention modules say which
(`is_causal`), and the packed attention follows them. A model whose layers the packed
attention cannot run (sliding windows, relative position embeddings, an architecture that
ignores custom attention) runs `padded`: length-sorted batches with a padding mask, through
the model's own SDPA attention.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from batchwright.engine.embed import attention
from batchwright.engine.embed.config import EmbedConfig, read_config
from batchwright.engine.embed.pooling import MODES
from batchwright.engine.loading.loader import fingerprint, resolve_device, resolve_dtype
from batchwright.engine.loading.onednn import use_onednn
from batchwright.engine.platform.host_memory import tune_malloc
from batchwright.registry import ModelSpec

log = logging.getLogger(__name__)

# Bump when a change here can change the vectors of the same weights and inputs.
EMBED_ENGINE_VERSION = "2"


@dataclass
class EmbedModel:
    model: Any
    tokenizer: PreTrainedTokenizerBase
    config: EmbedConfig
    pooling: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # token ids below it have an embedding
    context_length: int
    dim: int  # vector size
    causal: bool
    packed: bool  # the packed attention runs it (else padded batches)
    position_offset: int
    token_types: bool  # the forward takes token_type_ids (passed as zeros)
    pad_id: int
    fingerprint: str


def _causal(model: Any) -> bool:
    flags = [bool(m.is_causal) for m in model.modules() if hasattr(m, "is_causal")]
    if flags:
        return any(flags)
    return bool(getattr(model.config, "is_decoder", False))


def _packable(model: Any, loaded_with_ours: bool) -> str | None:
    """Why the packed attention cannot run this model, or None."""
    if not loaded_with_ours:
        return "its architecture takes no custom attention"
    config = model.config
    if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        return f"position_embedding_type {config.position_embedding_type!r}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"attention layer types {sorted(set(layer_types))}"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if getattr(config, "sliding_window", None) and getattr(config, "model_type", "") in (
        "modernbert",
    ):
        return "local attention windows"
    return None


def _from_pretrained(path: Path, dtype: torch.dtype) -> tuple[Any, bool]:
    attention.register()
    try:
        return AutoModel.from_pretrained(
            path, dtype=dtype, attn_implementation=attention.NAME
        ), True
    except (ValueError, KeyError):
        return AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa"), False


def _position_offset(model: Any) -> int:
    emb = getattr(model, "embeddings", None)
    if emb is not None and hasattr(emb, "create_position_ids_from_input_ids"):
        return int(emb.padding_idx) + 1  # RoBERTa counts positions from the padding index
    return 0


def load_embed_model(spec: ModelSpec) -> EmbedModel:
    path = Path(spec.path)
    config = read_config(spec)
    if config.pooling is not None and config.pooling not in MODES:
        raise ValueError(f"model {spec.name!r}: unknown pooling mode {config.pooling!r}")
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if device.type == "cpu":
        tune_malloc()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, ours = _from_pretrained(path, dtype)
    model.to(device)
    model.eval()
    onednn = bool(spec.onednn and device.type == "cpu" and use_onednn(model))
    why = _packable(model, ours)
    if why is not None:
        log.warning("%s runs padded batches (%s): slower than packed", spec.name, why)
    causal = _causal(model)
    pooling = config.pooling or ("lasttoken" if causal else "mean")
    hf = model.config.get_text_config()
    offset = _position_offset(model)
    max_pos = int(getattr(hf, "max_position_embeddings", 0) or 512) - offset
    context = spec.context_length or min(max_pos, config.max_seq_length or max_pos)
    dim = int(hf.hidden_size)
    for d in config.matryoshka:
        if not 0 < d <= dim:
            raise ValueError(f"model {spec.name!r}: Matryoshka dimension {d} outside 1-{dim}")
    params = inspect.signature(model.forward).parameters
    pad = tokenizer.pad_token_id
    engine_config = {
        "engine": "embed-" + EMBED_ENGINE_VERSION,
        "dtype": str(dtype),
        "device": device.type,
        "pooling": pooling,
        "normalize": config.normalize,
        "prompt": hashlib.sha256(config.prompt.encode()).hexdigest()[:16],
        "packed": why is None,
        "onednn": onednn,  # the linear layers' last bits differ from MKL's
        "context_length": context,
        "torch": ".".join(torch.__version__.split(".")[:2]),
        "transformers": ".".join(transformers.__version__.split(".")[:2]),
    }
    return EmbedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        pooling=pooling,
        device=device,
        dtype=dtype,
        vocab_size=int(model.get_input_embeddings().weight.shape[0]),
        context_length=context,
        dim=dim,
        causal=causal,
        packed=why is None,
        position_offset=offset,
        token_types="token_type_ids" in params,
        pad_id=int(pad) if isinstance(pad, int) else 0,
        fingerprint=fingerprint(path, engine_config),
    )
