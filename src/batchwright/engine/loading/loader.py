"""Load a registry model with transformers and compute its system_fingerprint."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from batchwright.engine.attention import backends
from batchwright.engine.attention import interface as attention
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.loading.demo import ensure_demo_model
from batchwright.engine.loading.invariance import rows_multiple
from batchwright.engine.loading.packing import pack
from batchwright.engine.platform.device import use
from batchwright.engine.platform.host_memory import tune_malloc
from batchwright.registry import DEMO_MODEL, ModelSpec

log = logging.getLogger(__name__)

# Bump when a change in the engine can change outputs for the same weights and parameters.
ENGINE_VERSION = "6"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FULL_HASH_LIMIT = 64 * 1024 * 1024
_SAMPLE_BLOCK = 1024 * 1024
_SAMPLES = 16


@dataclass
class LoadedModel:
    model: Any
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the output layer: valid token ids are below it
    context_length: int
    eos_ids: frozenset[int]
    cache_kwarg: str  # "cache" (transformers ≥5) or "past_key_values"
    has_logits_to_keep: bool
    fingerprint: str
    varlen: bool = False  # the model runs batchwright's variable-length attention
    native_attention: bool = False  # decode attention by the native kernel (native.py)
    chat_template: str | None = None  # the registry's template; None: the tokenizer's own
    backend: str = "reference"  # how attention reads the paged cache (attention.py)
    # Native backend: steps padded to multiples of this many tokens give each row the same
    # bits whatever shares its step (invariance.py); None: no such guarantee.
    invariant_rows: int | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)} or auto")
    return _DTYPES[name]


def _file_digest(path: Path) -> str:
    """Content hash; big weight files are sampled (size + evenly spaced blocks + header).

    Content rather than mtime so that the same weights copied to another host give the same
    fingerprint, without reading many gigabytes at every worker start.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            h.update(f.read())
        else:
            for i in range(_SAMPLES + 1):
                f.seek(min(size - _SAMPLE_BLOCK, i * (size - _SAMPLE_BLOCK) // _SAMPLES))
                h.update(f.read(_SAMPLE_BLOCK))
    return h.hexdigest()


def fingerprint(path: Path, config: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        # .jinja: chat templates (chat_template.jinja) change what chat lines generate.
        if f.is_file() and f.suffix in {
            ".safetensors",
            ".bin",
            ".json",
            ".model",
            ".txt",
            ".jinja",
        }:
            h.update(f.name.encode())
            h.update(_file_digest(f).encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    return "fp_" + h.hexdigest()[:10]


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def load_model(spec: ModelSpec) -> LoadedModel:
    path = Path(spec.path)
    if spec.name == DEMO_MODEL:
        ensure_demo_model(path)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if device.type == "cpu":
        tune_malloc()
    tokenizer = AutoTokenizer.from_pretrained(path)
    use(device)  # engine/device.py: what CUDA takes from the current device is the model's
    model, varlen = _from_pretrained(path, dtype)
    model.to(device)
    model.eval()
    pack(model)  # q/k/v and gate/up projections: one matmul each (packing.py)
    text_config = model.config.get_text_config()
    _check_supported(text_config)
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0]) if out is not None else int(text_config.vocab_size)
    max_pos = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
    context = spec.context_length or max_pos
    params = inspect.signature(model.forward).parameters
    # The kernel is float32 and CPU only; elsewhere decode attention runs on SDPA.
    native = (
        spec.native_attention
        and varlen
        and device.type == "cpu"
        and dtype == torch.float32
        and paged_attention_kernel() is not None
    )
    template = _chat_template(spec)
    backend = choose_backend(device, dtype, native)
    invariant = rows_multiple(model) if backend == "native" and spec.batch_invariant else None
    engine_config = {
        "engine": ENGINE_VERSION,
        "dtype": str(dtype),
        "device": device.type,
        "max_rows": spec.max_rows,
        "max_batch_tokens": spec.max_batch_tokens,
        "kv_tokens": spec.kv_tokens,
        "context_length": context,
        "varlen": varlen,
        "native_attention": native,
        "backend": backend,
        "invariant_rows": invariant,
        "torch": ".".join(torch.__version__.split(".")[:2]),
        "transformers": ".".join(transformers.__version__.split(".")[:2]),
    }
    if template is not None:
        engine_config["chat_template"] = hashlib.sha256(template.encode()).hexdigest()[:16]
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        vocab_size=vocab,
        context_length=context,
        eos_ids=_eos_ids(model, tokenizer),
        cache_kwarg="cache" if "cache" in params else "past_key_values",
        has_logits_to_keep="logits_to_keep" in params,
        fingerprint=fingerprint(path, engine_config),
        varlen=varlen,
        native_attention=native,
        chat_template=template,
        backend=backend,
        invariant_rows=invariant,
    )


def _chat_template(spec: ModelSpec) -> str | None:
    """The registry entry's template file (relative to the model's folder), if it names
    one; a file that cannot be read stops the load with the path in the message."""
    if spec.chat_template is None:
        return None
    path = (
        spec.chat_template if spec.chat_template.is_absolute() else spec.path / spec.chat_template
    )
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(
            f"model {spec.name!r}: chat_template {path}: {exc.strerror or exc}"
        ) from None


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    native: bool,
    missing: Callable[[], list[str]] = backends.varlen_missing,
) -> str:
    """How attention reads the paged cache (attention.py): native, varlen, reference. On
    CUDA in half precision `varlen` when torch's `varlen_attn` takes what the engine
    passes (`missing` says what it lacks); else the reference backend, said in one line,
    rather than an error at the first step."""
    if native:
        return "native"
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "reference"
    lacks = missing()
    if lacks:
        log.warning(
            "torch %s's varlen_attn lacks %s (torch >= 2.12 has them): attention runs the "
            "slower reference backend",
            torch.__version__,
            ", ".join(lacks),
        )
        return "reference"
    return "varlen"


def _check_supported(config: Any) -> None:
    """Refuse at load what the engine's cache and attention would silently get wrong."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported attention layer types {sorted(set(layer_types))}")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError("sliding-window attention is not supported")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping is not supported")


def _from_pretrained(path: Path, dtype: torch.dtype) -> tuple[Any, bool]:
    """The model with variable-length attention, or plain SDPA where it cannot take it."""
    attention.register()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention.NAME
        )
        return model, True
    except (ValueError, KeyError):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return model, False
