"""A PEFT LoRA adapter folder, read and checked against its base without torch.

An adapter folder is what PEFT's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors` (no tokenizer: the base's serves). Its tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]),
where `<module>` is the name of a linear layer of the base (`model.layers.0.self_attn.
q_proj`). The checks read the safetensors headers of the adapter and of the base (JSON
after an 8-byte length), so the CLI can refuse a malformed adapter before any worker
loads it, and the engine reads the same description before it loads the tensors.

What is refused, each in one line: not LoRA (`peft_type`), DoRA, trained biases, whole
modules saved beside the adapter (`modules_to_save`), `fan_in_fan_out` (GPT-2's Conv1D
layers), a tensor of no linear layer inside the base's decoder layers (embeddings and
`lm_head` included), a rank above the base's `max_lora_rank`, and shapes that do not fit
the base's weights (an adapter trained for another base).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# The linear layers an adapter may target sit inside decoder layers (`...layers.N.`).
_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_MAX_HEADER = 100 * 1024 * 1024


class AdapterError(ValueError):
    """The adapter cannot be served; the message is one line that says why."""


@dataclass(frozen=True)
class Target:
    """One adapted linear layer: its rank, its scaling and its shape."""

    module: str  # the base's module name, e.g. model.layers.0.self_attn.q_proj
    rank: int
    scaling: float
    in_features: int
    out_features: int
    a_key: str  # tensor names in adapter_model.safetensors
    b_key: str


@dataclass(frozen=True)
class AdapterInfo:
    path: Path
    targets: dict[str, Target]
    rank: int  # the largest rank of any target
    digest: str  # content hash of the folder's config and weights
    target_names: list[str] = field(default_factory=list)  # q_proj, v_proj, ... (sorted)


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{path}: not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise AdapterError(f"{path}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except OSError as exc:
        raise AdapterError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        if isinstance(exc, AdapterError):
            raise
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    return header


def base_shapes(base: Path) -> dict[str, list[int]]:
    """Shape of every weight of a base model folder (sharded or not)."""
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"base model folder {base} has no .safetensors weights to check against")
    shapes: dict[str, list[int]] = {}
    for f in files:
        for name, meta in safetensors_header(f).items():
            shapes[name] = list(meta.get("shape", []))
    return shapes


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose name ends with
    it at a dot boundary (PEFT: re.match(rf"(.*\\.)?({key})$", name))."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        h.update(name.encode())
        h.update((folder / name).read_bytes())
    return h.hexdigest()[:16]


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(
            f"{folder}: no {CONFIG} (a PEFT adapter folder holds {CONFIG} and {WEIGHTS})"
        ) from None
    except OSError as exc:
        raise AdapterError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AdapterError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return config


def _refuse_unsupported(config: dict[str, Any], where: Path) -> None:
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") not in (None, "none"):
        raise AdapterError(f"{where}: adapters that train biases (bias={config['bias']!r})")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where}: modules_to_save {config['modules_to_save']} replaces whole modules; "
            "only low-rank deltas of linear layers can share the base's forward"
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out (Conv1D layers) is not supported")


def describe(folder: Path, base_shape: dict[str, list[int]] | None = None) -> AdapterInfo:
    """Read an adapter folder; with `base_shape` (base_shapes of the base) check that
    every adapted layer exists in the base with the shapes the adapter expects."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    config = read_config(folder)
    _refuse_unsupported(config, folder / CONFIG)
    weights = folder / WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{folder}: no {WEIGHTS}")
    header = safetensors_header(weights)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora"))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for key, meta in header.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(
                f"{folder}: tensor {key!r} is not a LoRA A/B matrix of a linear layer "
                "(embeddings, lm_head and saved modules cannot share the base's forward)"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = (key, list(meta.get("shape", [])))
    if not pairs:
        raise AdapterError(f"{folder}: {WEIGHTS} holds no LoRA tensors")
    targets: dict[str, Target] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {module} has lora_{''.join(ab)} without its pair")
        (a_key, a_shape), (b_key, b_shape) = ab["A"], ab["B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise AdapterError(
                f"{folder}: {module}: lora_A {a_shape} and lora_B {b_shape} do not make a "
                "low-rank pair"
            )
        if not _IN_LAYER.search(module):
            raise AdapterError(
                f"{folder}: target module {module} is not a linear layer of a decoder layer"
            )
        rank = a_shape[0]
        r_cfg = int(_pattern_value(rank_pattern, module, config.get("r", rank)))
        if r_cfg != rank:
            raise AdapterError(f"{folder}: {module} has rank {rank}, its config says {r_cfg}")
        a = float(_pattern_value(alpha_pattern, module, alpha))
        scaling = a / math.sqrt(rank) if rslora else a / rank
        if base_shape is not None:
            shape = base_shape.get(module + ".weight")
            if shape is None:
                raise AdapterError(
                    f"{folder}: target module {module} does not exist in the base model"
                )
            if shape != [b_shape[0], a_shape[1]]:
                raise AdapterError(
                    f"{folder}: {module} is {a_shape[1]}->{b_shape[0]} in the adapter but "
                    f"{shape[1]}->{shape[0]} in the base: trained for another base model"
                )
        targets[module] = Target(module, rank, scaling, a_shape[1], b_shape[0], a_key, b_key)
    names = sorted({m.rsplit(".", 1)[-1] for m in targets})
    return AdapterInfo(
        folder, targets, max(t.rank for t in targets.values()), _digest(folder), names
    )


def check(folder: Path, base: Path, max_rank: int) -> AdapterInfo:
    """The whole check of an adapter for a base model folder (what `adapters add` runs)."""
    info = describe(folder, base_shapes(Path(base)))
    if info.rank > max_rank:
        raise AdapterError(
            f"{folder}: rank {info.rank} is above the base's max_lora_rank {max_rank}"
        )
    return info
