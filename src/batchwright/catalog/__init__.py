"""The catalog of model names a request may give: the registry's models and adapters, and
the LoRA adapters added at run time (the `lora_adapters` table, `batchwright adapters`).

Torch-free: the API validates names with it, workers ask it which adapters their base
model has (for claims, and to pick up adapters added or removed without a restart).
"""

from batchwright.catalog.store import (
    AdapterRow,
    adapters_of,
    add_adapter,
    cached_registry,
    family,
    list_adapters,
    registry,
    remove_adapter,
)

__all__ = [
    "AdapterRow",
    "adapters_of",
    "add_adapter",
    "cached_registry",
    "family",
    "list_adapters",
    "registry",
    "remove_adapter",
]
