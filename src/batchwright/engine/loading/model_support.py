"""What a loaded model needs of the engine, found at load: refusals, the attention path
and the KV cache's shape.

Each check answers before any line is claimed, in one line (`ModelRefused`):

- from the config: an encoder-decoder, layers that are not attention (state-space,
  linear attention, convolutions: named by kind), RoPE whose frequencies depend on the
  longest position in the forward (`dynamic`, `longrope`) where the context can reach
  past the length they switch at;
- from loading: weights transformers had to initialise (a head the checkpoint lacks);
- from one probe forward of two four-token rows that differ in their last token: what
  each layer hands the attention interface (its KV heads and key and value widths, its
  sliding window, soft-capping, sinks, anything else), and whether the earlier positions
  moved when the last token changed (attention that looks ahead: an encoder).

What the fast path cannot apply sends the model to the reference path (transformers' own
attention over the paged cache, padded.py), said in one log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from batchwright.engine.attention import interface as attention
from batchwright.engine.attention import variants
from batchwright.engine.kv.paged import LayerShape
from batchwright.engine.requests.types import ModelRefused

log = logging.getLogger(__name__)

# Layer kinds as configs name them (layer_types, layers_block_type, ...) that are attention.
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "attention", "global", "local"})
# ... that are attention the fast path does not do (transformers' masks do).
REFERENCE_KINDS = frozenset({"chunked_attention"})
# Architectures with no attention at all.
STATE_SPACE = {
    "mamba": "state-space (Mamba)",
    "mamba2": "state-space (Mamba2)",
    "falcon_mamba": "state-space (Mamba)",
    "rwkv": "linear attention (RWKV)",
    "xlstm": "recurrent (xLSTM)",
}
# RoPE types whose frequencies transformers recomputes from the forward's longest position.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class Support:
    """What the engine serves the model with."""

    # Per layer (kv_heads, key dim, value dim): what the attention interface is handed
    # (the fast path stores that), and what the layer stores in transformers' cache (the
    # reference path: for multi-head latent attention the latent, not the heads).
    shapes: list[LayerShape]
    cache_shapes: list[LayerShape] = field(default_factory=list)
    reference: str | None = None  # why it runs on the reference path, or None (fast path)
    softcap: bool = False  # a layer soft-caps its scores (not on varlen_attn)
    sinks: bool = False  # a layer has attention sinks
    windows: dict[int, int] = field(default_factory=dict)  # layer -> sliding window
    context_length: int | None = None  # a cap the model needs (RoPE), or None


def check_config(config: Any, context_length: int, configured: bool) -> int:
    """Refusals that the config alone gives; returns the context length to serve (capped
    where RoPE scaling would switch past it and the registry did not set one)."""
    arch = _arch(config)
    if getattr(config, "is_encoder_decoder", False):
        raise ModelRefused(f"{arch}: an encoder-decoder model, not a causal decoder")
    text = config.get_text_config()
    kind = STATE_SPACE.get(str(getattr(text, "model_type", "")))
    if kind is not None:
        raise ModelRefused(f"{arch}: its layers are {kind}, not attention")
    others = sorted(
        {k for k in layer_kinds(text) if k not in ATTENTION_KINDS and k not in REFERENCE_KINDS}
    )
    if others:
        raise ModelRefused(
            f"{arch}: layers of kind {', '.join(others)} are not attention "
            "(the engine serves attention layers only)"
        )
    return _rope_context(text, arch, context_length, configured)


def layer_kinds(config: Any) -> list[str]:
    """Each layer's kind as the config names it (empty when it does not)."""
    for attr in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(config, attr, None)
        if isinstance(kinds, list | tuple) and kinds:
            return [str(k) for k in kinds]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        return [names.get(c, c) for c in pattern if names.get(c, c) not in ("mlp", "moe")]
    return []


def _rope_context(config: Any, arch: str, context: int, configured: bool) -> int:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return context
    if all(isinstance(v, dict) for v in params.values()) and params:
        types = {str(v.get("rope_type", v.get("type", ""))): v for v in params.values()}
    else:
        types = {str(params.get("rope_type", params.get("type", ""))): params}
    for rope_type, p in types.items():
        if not any(t in rope_type for t in _LENGTH_DEPENDENT_ROPE):
            continue
        limit = int(
            p.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings
        )
        if rope_type == "dynamic" or "dynamic" in rope_type:
            limit = int(config.max_position_embeddings)
        if context <= limit:
            continue
        # transformers computes these frequencies from the longest position of the whole
        # forward, and the engine packs many rows into one: past `limit` each row's text
        # would depend on its neighbours. Below it they are the unscaled frequencies.
        if configured:
            raise ModelRefused(
                f"{arch}: {rope_type} RoPE scaling changes with the longest sequence in a "
                f"forward, which would make rows depend on each other past {limit} tokens; "
                f"set the registry's context_length to at most {limit}"
            )
        log.warning(
            "%s: %s RoPE scaling switches past %d tokens, so the context is %d (not %d)",
            arch,
            rope_type,
            limit,
            limit,
            context,
        )
        context = limit
    return context


def check_loading(config: Any, info: dict[str, Any] | None) -> None:
    """A load that left weights newly initialised is an error, not a warning."""
    if not info:
        return
    fresh = sorted({*info.get("missing_keys", ()), *info.get("mismatched_keys", ())})
    fresh = [str(k if isinstance(k, str) else k[0]) for k in fresh]
    if fresh:
        shown = ", ".join(fresh[:3]) + (f" and {len(fresh) - 3} more" if len(fresh) > 3 else "")
        raise ModelRefused(
            f"{_arch(config)}: the checkpoint lacks weights the causal-LM head needs "
            f"(transformers would initialise {shown} at random)"
        )


@dataclass
class _Seen:
    shapes: dict[int, LayerShape] = field(default_factory=dict)
    windows: dict[int, int] = field(default_factory=dict)
    softcap: bool = False
    sinks: bool = False
    unknown: set[str] = field(default_factory=set)
    bidirectional: bool = False
    no_index: bool = False

    def __call__(self, module: Any, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> None:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            self.no_index = True
            return
        self.shapes[layer] = (int(k.shape[1]), int(k.shape[3]), int(v.shape[3]))
        window = kwargs.get("sliding_window")
        if window is not None:
            self.windows[layer] = int(window)
        self.softcap |= kwargs.get("softcap") is not None
        self.sinks |= kwargs.get("s_aux") is not None
        self.unknown.update(variants.unknown(kwargs))
        self.bidirectional |= getattr(module, "is_causal", True) is False


@torch.inference_mode()
def probe(model: Any, *, varlen: bool, cache_kwarg: str, context: int) -> Support:
    """One forward of two short rows; see the module docstring."""
    config = model.config.get_text_config()
    arch = _arch(model.config)
    device = next(model.parameters()).device
    vocab = int(config.vocab_size)
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]], device=device) % max(vocab, 6)
    seen = _Seen()
    cache = DynamicCache()
    token = attention.PROBE.set(seen)
    try:
        logits = model(input_ids=ids, use_cache=True, **{cache_kwarg: cache}).logits.float()
    except Exception as exc:  # what cannot run one forward cannot be served
        raise ModelRefused(f"{arch}: a test forward failed: {type(exc).__name__}: {exc}") from None
    finally:
        attention.PROBE.reset(token)
    # Both rows run in the same kernels; half precision rounds coarser.
    scale = float(logits.abs().max()) + 1.0
    tolerance = (1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2) * scale
    if seen.bidirectional or not torch.allclose(
        logits[0, :3], logits[1, :3], rtol=0.0, atol=tolerance
    ):
        raise ModelRefused(
            f"{arch}: earlier positions attend to later ones (an encoder or a bidirectional "
            "model), not a causal decoder"
        )
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    stored = _cache_shapes(cache)
    shapes = seen.shapes or stored
    missing = [i for i in range(layers) if i not in shapes or i not in stored]
    if missing:
        raise ModelRefused(f"{arch}: layers {missing} hold no attention KV cache")
    support = Support(
        shapes=[shapes[i] for i in range(max(layers, len(shapes)))],
        cache_shapes=[stored[i] for i in range(max(layers, len(stored)))],
        softcap=seen.softcap,
        sinks=seen.sinks,
        windows={i: w for i, w in seen.windows.items() if w < context},
    )
    kinds = set(layer_kinds(config)) & REFERENCE_KINDS
    if not varlen:
        support.reference = "it does not take the engine's attention implementation"
    elif kinds:
        support.reference = f"layers of kind {', '.join(sorted(kinds))}"
    elif seen.unknown:
        support.reference = f"its attention takes {', '.join(sorted(seen.unknown))}"
    elif seen.no_index:
        support.reference = "its attention modules carry no layer index"
    return support


def _cache_shapes(cache: DynamicCache) -> dict[int, LayerShape]:
    out: dict[int, LayerShape] = {}
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            out[i] = (int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]))
    return out


def _arch(config: Any) -> str:
    names = getattr(config, "architectures", None) or [getattr(config, "model_type", "model")]
    return str(names[0])
