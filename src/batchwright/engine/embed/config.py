"""What an embedding model does after its transformer, read from its sentence-transformers
files (modules.json, 1_Pooling/config.json, config_sentence_transformers.json,
sentence_bert_config.json) and config.json, with the registry's `embedding` table on top.

A module this engine does not run (a Dense projection, say) stops the load in one line:
serving it without would give other vectors than the model's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchwright.registry import ModelSpec

# Module types by class name: sentence-transformers writes `sentence_transformers.models.X`
# up to version 5 and other module paths since.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# Pooling's config keys, in the order sentence-transformers concatenates their outputs.
_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class EmbedConfig:
    # cls | mean | max | mean_sqrt_len_tokens | weightedmean | lasttoken; None: the model
    # says nothing (then lasttoken for a causal model, mean for an encoder: model.py).
    pooling: str | None
    normalize: bool
    prompt: str  # put before every text input ("" for none)
    include_prompt: bool  # whether the prompt's tokens are pooled (sentence-transformers')
    matryoshka: tuple[int, ...]  # sizes `dimensions` may take besides the full one
    max_seq_length: int | None  # sentence_bert_config.json's, if any
    do_lower_case: bool


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _modules(path: Path) -> list[dict[str, Any]]:
    file = path / "modules.json"
    if not file.is_file():
        return []
    try:
        modules = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from None
    if not isinstance(modules, list):
        raise ValueError(f"{file}: expected a list of modules")
    return [m for m in modules if isinstance(m, dict)]


def _kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _pooling(path: Path, modules: list[dict[str, Any]]) -> tuple[str | None, bool]:
    folder = next((m.get("path", "") for m in modules if _kind(m) == _POOLING), None)
    if folder is None:
        return None, True
    config = _read(path / str(folder) / "config.json")
    modes = [mode for key, mode in _MODES.items() if config.get(key)]
    mode = config.get("pooling_mode")  # sentence-transformers 6 writes the mode itself
    if isinstance(mode, list):
        modes += [str(m) for m in mode]
    elif isinstance(mode, str):
        modes.append(mode)
    modes = list(dict.fromkeys(modes))
    if len(modes) > 1:
        raise ValueError(f"{path}: pooling modes {modes} together (concatenated) are not supported")
    return (modes[0] if modes else None), bool(config.get("include_prompt", True))


def read_config(spec: ModelSpec) -> EmbedConfig:
    path = Path(spec.path)
    modules = _modules(path)
    for m in modules:
        if _kind(m) not in (_TRANSFORMER, _POOLING, _NORMALIZE):
            raise ValueError(
                f"model {spec.name!r}: sentence-transformers module {m.get('type')!r} is not "
                "supported (batchwright runs Transformer, Pooling and Normalize)"
            )
    pooling, include_prompt = _pooling(path, modules)
    st = _read(path / "config_sentence_transformers.json")
    prompts = st.get("prompts") or {}
    default = st.get("default_prompt_name")
    prompt = str(prompts.get(default, "")) if isinstance(prompts, dict) and default else ""
    bert = _read(path / "sentence_bert_config.json")
    hf = _read(path / "config.json")
    matryoshka = hf.get("matryoshka_dimensions") or []
    opts = spec.embedding
    if opts is not None:
        pooling = opts.pooling or pooling
        prompt = opts.prompt if opts.prompt is not None else prompt
        matryoshka = opts.matryoshka_dimensions or matryoshka
    normalize = any(_kind(m) == _NORMALIZE for m in modules)
    if opts is not None and opts.normalize is not None:
        normalize = opts.normalize
    max_len = bert.get("max_seq_length")
    return EmbedConfig(
        pooling=pooling,
        normalize=normalize,
        prompt=prompt,
        include_prompt=include_prompt,
        matryoshka=tuple(int(d) for d in matryoshka),
        max_seq_length=int(max_len) if isinstance(max_len, int) else None,
        do_lower_case=bool(bert.get("do_lower_case", False)),
    )
