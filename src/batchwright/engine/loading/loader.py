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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from batchwright.engine.attention import backends
from batchwright.engine.attention import interface as attention
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.loading.demo import ensure_demo_model
from batchwright.engine.loading.fused import use_fused
from batchwright.engine.loading.invariance import rows_multiple
from batchwright.engine.loading.model_support import Support, check_config, check_loading, probe
from batchwright.engine.loading.onednn import use_onednn
from batchwright.engine.loading.packing import pack
from batchwright.engine.platform.device import use
from batchwright.engine.platform.host_memory import tune_malloc
from batchwright.registry import DEMO_MODEL, ModelSpec

log = logging.getLogger(__name__)

# Bump when a change in the engine can change outputs for the same weights and parameters.
ENGINE_VERSION = "7"

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
    # Per layer (kv_heads, key dim, value dim) as the model projects them; the KV cache's
    # shape (engine/loading/model_support.py).
    kv_shapes: list[tuple[int, int, int]] | None = None
    # Why the model runs on the reference path (transformers' attention, padded.py).
    reference_reason: str | None = None


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


def load_model(spec: ModelSpec, *, reference: bool = False) -> LoadedModel:
    """The registry's model, loaded and checked (engine/loading/model_support.py): a model the
    engine cannot serve raises ModelRefused here, before any work. `reference` runs it on
    the reference path whatever it supports (tests compare the two)."""
    path = Path(spec.path)
    if spec.name == DEMO_MODEL:
        ensure_demo_model(path)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if device.type == "cpu":
        tune_malloc()
    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config()
    max_pos = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
    context = check_config(
        config, spec.context_length or max_pos, configured=spec.context_length is not None
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    use(device)  # engine/platform/device.py: what CUDA takes from the current device is the model's
    model, varlen, info = _from_pretrained(path, dtype)
    check_loading(config, info)
    model.to(device)
    model.eval()
    params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    support = probe(model, varlen=varlen, cache_kwarg=cache_kwarg, context=context)
    if reference and support.reference is None:
        support.reference = "asked for"
    if varlen and support.reference is not None:
        _reference_attention(model, support)
        varlen = False
    if support.reference is not None and not reference:
        log.warning(
            "%s runs on the reference path (transformers' attention, slower): %s",
            spec.name,
            support.reference,
        )
    pack(model)  # q/k/v and gate/up projections: one matmul each (packing.py)
    onednn = 0
    if device.type == "cpu":
        if spec.onednn:
            onednn = use_onednn(model)  # float32 linear layers through oneDNN (onednn.py)
        if not spec.torch_compile:  # compiled, inductor fuses them (fused.py)
            use_fused(model)  # RMSNorm and rotary in one native pass each (fused.py)
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0]) if out is not None else int(text_config.vocab_size)
    # The kernel is float32 and CPU only; elsewhere decode attention runs on SDPA.
    native = (
        spec.native_attention
        and varlen
        and device.type == "cpu"
        and dtype == torch.float32
        and paged_attention_kernel() is not None
    )
    template = _chat_template(spec)
    backend = _fit_backend(choose_backend(device, dtype, native), support, spec.name)
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
        "onednn": onednn > 0,  # the linear layers' last bits differ from MKL's
        "backend": backend,
        "invariant_rows": invariant,
        "reference_path": support.reference is not None,
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
        cache_kwarg=cache_kwarg,
        has_logits_to_keep="logits_to_keep" in params,
        fingerprint=fingerprint(path, engine_config),
        varlen=varlen,
        native_attention=native,
        chat_template=template,
        backend=backend,
        invariant_rows=invariant,
        kv_shapes=support.shapes if support.reference is None else support.cache_shapes,
        reference_reason=support.reference,
    )


def _fit_backend(backend: str, support: Support, name: str) -> str:
    """`varlen_attn` has no soft-capping and one head width for keys and values: such
    models take the reference backend on CUDA, said in one line."""
    if backend != "varlen":
        return backend
    widths = any(dk != dv for _, dk, dv in support.shapes)
    if support.softcap or widths:
        why = "soft-capped attention" if support.softcap else "keys and values of other widths"
        log.warning("%s: varlen_attn lacks %s; attention runs the reference backend", name, why)
        return "reference"
    return backend


def _reference_attention(model: Any, support: Support) -> None:
    """transformers' own attention for the reference path: SDPA where the model takes it
    and needs nothing SDPA lacks, else its eager attention."""
    if not (support.softcap or support.sinks):
        try:
            model.set_attn_implementation("sdpa")
            return
        except (ValueError, ImportError):
            pass
    model.set_attn_implementation("eager")


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


def _from_pretrained(path: Path, dtype: torch.dtype) -> tuple[Any, bool, dict[str, Any]]:
    """The model with variable-length attention, or transformers' own where it cannot
    take it; with transformers' loading report (what it had to initialise)."""
    attention.register()
    load: Any = AutoModelForCausalLM.from_pretrained  # typed as returning the model alone
    try:
        model, info = load(
            path, dtype=dtype, attn_implementation=attention.NAME, output_loading_info=True
        )
        return model, True, info
    except (ValueError, KeyError):
        pass
    try:
        model, info = load(path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    except ValueError:
        model, info = load(path, dtype=dtype, attn_implementation="eager", output_loading_info=True)
    return model, False, info
