"""The paged KV pools of a loaded model, shaped by its config and sized by its spec."""

from __future__ import annotations

from batchwright.engine.kv.paged import PagedCache, block_size_for, pool_blocks
from batchwright.engine.loading.loader import LoadedModel
from batchwright.registry import ModelSpec


def new_cache(lm: LoadedModel, spec: ModelSpec, max_rows: int) -> PagedCache:
    cfg = lm.model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    # Each layer's KV shape as the model projects it (the loader's probe); the config's
    # fields only where none was taken.
    shapes = lm.kv_shapes or [(kv_heads, head_dim, head_dim)] * int(cfg.num_hidden_layers)
    device = lm.device
    bs = block_size_for(device, spec.kv_block_size)
    token_bytes = sum(h * (dk + dv) for h, dk, dv in shapes) * lm.dtype.itemsize
    blocks = pool_blocks(
        kv_tokens=spec.kv_tokens,
        max_rows=max_rows,
        context_length=lm.context_length,
        block_size=bs,
        token_bytes=token_bytes,
        device=device,
    )
    return PagedCache(
        layers=len(shapes),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=lm.dtype,
        device=device,
        block_size=bs,
        num_blocks=blocks,
        max_rows=max_rows,
        context_length=lm.context_length,
        shapes=shapes,
    )
