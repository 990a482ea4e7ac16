"""Model registry: which model names exist and where their HF-format files lie.

Torch-free so the API can validate model names. Sources, first match wins:
BATCHWRIGHT_MODELS (inline JSON), BATCHWRIGHT_MODELS_FILE (TOML or JSON), else just `demo`.
Shape: {"models": {"name": {"path": "...", "device": "auto", "dtype": "auto", ...}}}
An entry with `base` is a LoRA adapter of that model: {"base": "llama", "adapter": "/dir"}
(a PEFT folder, adapter_files.py); its name is a model name everywhere, and its lines run
in the base's forward. Adapters added at run time live in the database (catalog/).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchwright.config import Settings, get_settings

DEMO_MODEL = "demo"


# sentence-transformers' pooling modes (its models/Pooling.py).
PoolingMode = Literal["cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean"]


class EmbeddingOptions(BaseModel):
    """An embedding model's settings where its sentence-transformers files say otherwise or
    nothing (`[models.NAME.embedding]`); unset, they are read from those files."""

    model_config = ConfigDict(extra="forbid")

    pooling: PoolingMode | None = None  # default: 1_Pooling/config.json, else mean
    normalize: bool | None = None  # default: a Normalize module in modules.json
    # Text put before every text input (token-id inputs are embedded as given). Default: the
    # prompt config_sentence_transformers.json names as its default_prompt_name.
    prompt: str | None = None
    # Sizes `dimensions` may truncate to (then re-normalised). Default: config.json's
    # `matryoshka_dimensions`; a model with neither answers `dimensions` with a 400.
    matryoshka_dimensions: list[int] | None = None


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    # "embed": serves /v1/embeddings only; "generate": /v1/completions and chat. Default:
    # "embed" for a sentence-transformers folder (modules.json), else "generate". An API
    # host that cannot read the model's folder needs it said here.
    task: Literal["generate", "embed"] | None = None
    embedding: EmbeddingOptions | None = None
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
    # CPU float32: linear layers through oneDNN with their weights reordered once at load
    # (engine/loading/onednn.py: 1.2-1.7x MKL's speed here, the same bits at any row
    # count), at the cost of a second copy of the linear weights. False: MKL.
    onednn: bool = True
    # Native attention: a line's result is the same bits whatever shares its steps (a
    # preempted line recomputed, a seeded line in another batch): steps padded to the row
    # multiple the CPU's matrix multiply needs, checked at load, and prompts attended by
    # the paged kernel (engine/loading/invariance.py; cost in docs/engine.md). False: faster long
    # prompts, and lines equal only up to near ties.
    batch_invariant: bool = True
    # KV-cache budget in tokens (paged blocks; rows are admitted while it lasts). Default:
    # max_rows rows of full context, on CUDA at most 60 % of the memory free after loading.
    kv_tokens: int | None = None
    # Tokens per KV block (also the granularity of shared-prefix reuse). Default: 256 on
    # CUDA (FlashAttention's paged kernel), 64 elsewhere (see engine/kv/paged.py).
    kv_block_size: int | None = Field(default=None, ge=1)
    # Shared-prefix reuse: full prompt blocks stay in the paged cache, indexed by their
    # tokens, and later prompts that start with them skip their prefill (engine/kv/prefix.py).
    # On by default, as in the serving engines users compare us with: on files that share
    # nothing it costs within noise (docs/prefix.md, bench/prefix_bench.py --overhead).
    prefix_cache: bool = True
    # CUDA graphs: steady decode steps (no prompt admitted) replay a graph recorded per
    # row and KV-length bucket (engine/runner/graphs.py). Default (None): on CUDA with the varlen
    # attention, off elsewhere. A capture that fails logs one line and the run goes on
    # eagerly.
    cuda_graphs: bool | None = None
    # torch.compile the forward and the sampler (engine/platform/compiled.py). Default (None): on
    # CUDA with the varlen attention, off elsewhere (the first run on a CPU starts fast).
    torch_compile: bool | None = None
    # Tokens of cached prefixes kept once no running row uses them (LRU beyond that; they
    # also give way to new rows when the KV budget runs out). Default: on CUDA the whole
    # pool (allocated anyway), elsewhere 8192 (memory a CPU worker keeps resident).
    prefix_cache_tokens: int | None = None
    # Rows kept free of batch lines for online requests (POST /v1/completions). 0: an
    # online request takes batch rows when none are free (engine/scheduling/preempt.py), at the next
    # step either way; a reserve only spares the preempted lines' recomputation, and costs
    # the batch those rows whether online traffic comes or not.
    online_rows: int = Field(default=0, ge=0)
    # A Jinja chat template file for /v1/chat/completions lines (relative paths are read
    # from `path`); default: the tokenizer's own (tokenizer_config.json or
    # chat_template.jinja). A model with neither answers chat lines with a 400.
    chat_template: Path | None = None
    # LoRA adapters of this model (engine/lora/): adapters held on the device at once
    # (least recently used out beyond that; a row whose adapter has no slot waits), and
    # the largest rank an adapter may have (slot tensors are this wide). 0: no adapters.
    max_loras: int = Field(default=8, ge=0)
    max_lora_rank: int = Field(default=16, ge=1)

    @property
    def kind(self) -> Literal["generate", "embed"]:
        """What the model does: `task`, else found from its folder's layout."""
        if self.task is not None:
            return self.task
        if self.embedding is not None or (self.path / "modules.json").is_file():
            return "embed"
        return "generate"


class AdapterSpec(BaseModel):
    """A LoRA adapter served in its base model's forward: `adapter` is a PEFT folder."""

    model_config = ConfigDict(extra="forbid")

    name: str
    base: str
    adapter: Path


class Registry(BaseModel):
    models: dict[str, ModelSpec]
    adapters: dict[str, AdapterSpec] = Field(default_factory=dict)

    def get(self, name: str) -> ModelSpec | None:
        """A whole model (never an adapter)."""
        return self.models.get(name)

    def serving(self, name: str) -> ModelSpec | None:
        """The model whose workers serve `name`: itself, or an adapter's base."""
        adapter = self.adapters.get(name)
        return self.models.get(adapter.base if adapter is not None else name)

    def base_of(self, name: str) -> str:
        """The model name whose queue and workers serve `name`."""
        adapter = self.adapters.get(name)
        return adapter.base if adapter is not None else name

    def family(self, base: str) -> list[str]:
        """`base` and its adapters: the model names of lines its workers take."""
        return [base, *sorted(n for n, a in self.adapters.items() if a.base == base)]

    @property
    def names(self) -> list[str]:
        """Whole models (what a worker loads)."""
        return sorted(self.models)

    @property
    def all_names(self) -> list[str]:
        """Every name a request may give: models and adapters."""
        return sorted([*self.models, *self.adapters])


def _demo_spec(settings: Settings) -> ModelSpec:
    return ModelSpec(name=DEMO_MODEL, path=settings.home / "models" / DEMO_MODEL)


class RegistryError(ValueError):
    """The registry cannot be read; the message is one line naming the source and why."""


def _parse(raw: dict[str, object], settings: Settings) -> Registry:
    entries = raw.get("models", raw)
    if not isinstance(entries, dict):
        raise ValueError("expected a [models] table")
    models: dict[str, ModelSpec] = {}
    adapters: dict[str, AdapterSpec] = {}
    for name, spec in entries.items():
        if isinstance(spec, dict) and "base" in spec:
            adapters[name] = _adapter(name, spec)
            continue
        if not isinstance(spec, dict) or "path" not in spec:
            # `[models.qwen2.5-0.5b]` unquoted makes nested tables: no path at this level.
            raise ValueError(
                f"entry {name!r} has no 'path' (a name with dots needs quotes: "
                '[models."qwen2.5-0.5b"])'
                if isinstance(spec, dict)
                else f"entry {name!r} must be a table"
            )
        try:
            models[name] = ModelSpec(name=name, **spec)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ValueError(f"entry {name!r}: {where}: {first['msg']}") from None
    if DEMO_MODEL not in models:
        models[DEMO_MODEL] = _demo_spec(settings)
    for name, adapter in adapters.items():
        if adapter.base not in models:
            raise ValueError(
                f"adapter {name!r}: base {adapter.base!r} is not a model of the registry"
            )
    return Registry(models=models, adapters=adapters)


def _adapter(name: str, spec: dict[str, object]) -> AdapterSpec:
    if "adapter" not in spec:
        raise ValueError(f"adapter {name!r} has a base but no 'adapter' folder")
    try:
        return AdapterSpec(name=name, **spec)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"adapter {name!r}: {where}: {first['msg']}") from None


def load_registry(settings: Settings | None = None) -> Registry:
    settings = settings or get_settings()
    if settings.models:
        source = "BATCHWRIGHT_MODELS"
        try:
            return _parse(json.loads(settings.models), settings)
        except ValueError as exc:  # JSONDecodeError is one
            raise RegistryError(f"model registry {source}: {exc}") from None
    if settings.models_file:
        path = settings.models_file
        try:
            text = path.read_text()
            raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
            return _parse(raw, settings)
        except FileNotFoundError:
            raise RegistryError(f"model registry {path}: file not found") from None
        except OSError as exc:
            raise RegistryError(f"model registry {path}: {exc.strerror or exc}") from None
        except ValueError as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
            raise RegistryError(f"model registry {path}: {exc}") from None
    return Registry(models={DEMO_MODEL: _demo_spec(settings)})
