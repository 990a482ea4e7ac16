"""Model registry: which model names exist and where their HF-format files lie.

Torch-free so the API can validate model names. Sources, first match wins:
BATCHWRIGHT_MODELS (inline JSON), BATCHWRIGHT_MODELS_FILE (TOML or JSON), else just `demo`.
Shape: {"models": {"name": {"path": "...", "device": "auto", "dtype": "auto", ...}}}
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from batchwright.config import Settings, get_settings

DEMO_MODEL = "demo"


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    # Local HF-format directory. For `demo` it is built on first use when missing.
    path: Path
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    max_rows: int = 64  # sequences decoded together
    max_batch_tokens: int = 16384  # prompt tokens prefilled in one forward
    context_length: int | None = None  # default: the model config's max_position_embeddings
    # CPU float32: decode attention by the native kernel (built on first use with the
    # machine's C++ compiler; without one the SDPA path runs, same results).
    native_attention: bool = True
    # KV-cache budget in tokens (paged blocks; rows are admitted while it lasts). Default:
    # max_rows rows of full context, on CUDA at most 60 % of the memory free after loading.
    kv_tokens: int | None = None
    # Shared-prefix reuse: full prompt blocks stay in the paged cache, indexed by their
    # tokens, and later prompts that start with them skip their prefill (engine/prefix.py).
    prefix_cache: bool = True
    # Tokens of cached prefixes kept once no running row uses them (LRU beyond that; they
    # also give way to new rows when the KV budget runs out). Default: on CUDA the whole
    # pool (allocated anyway), elsewhere 8192 (memory a CPU worker keeps resident).
    prefix_cache_tokens: int | None = None


class Registry(BaseModel):
    models: dict[str, ModelSpec]

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self.models)


def _demo_spec(settings: Settings) -> ModelSpec:
    return ModelSpec(name=DEMO_MODEL, path=settings.home / "models" / DEMO_MODEL)


def _parse(raw: dict[str, object], settings: Settings) -> Registry:
    entries = raw.get("models", raw)
    if not isinstance(entries, dict):
        raise ValueError("model registry: expected a table of models")
    models: dict[str, ModelSpec] = {}
    for name, spec in entries.items():
        if not isinstance(spec, dict):
            raise ValueError(f"model registry: entry {name!r} must be a table")
        models[name] = ModelSpec(name=name, **spec)
    if DEMO_MODEL not in models:
        models[DEMO_MODEL] = _demo_spec(settings)
    return Registry(models=models)


def load_registry(settings: Settings | None = None) -> Registry:
    settings = settings or get_settings()
    if settings.models:
        return _parse(json.loads(settings.models), settings)
    if settings.models_file:
        text = settings.models_file.read_text()
        if settings.models_file.suffix == ".json":
            return _parse(json.loads(text), settings)
        return _parse(tomllib.loads(text), settings)
    return Registry(models={DEMO_MODEL: _demo_spec(settings)})
