"""Warnings third-party packages log while being imported, which say nothing to a user.

With torchao installed (quantized checkpoints), transformers imports it whenever it loads
a model, and the import logs one line per CUDA kernel library that a CPU-only machine
cannot load and one per enum it registers with a deprecated torch call: noise on every
process's stderr (`batchwright run` prints its own progress there). Dropped by message,
before anything imports transformers; everything else those loggers say still shows.
"""

from __future__ import annotations

import logging

_NOISE = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


def _filter(prefixes: tuple[str, ...]) -> logging.Filter:
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return not any(p in message for p in prefixes)

    return Drop()


def quiet() -> None:
    for name, prefixes in _NOISE.items():
        logging.getLogger(name).addFilter(_filter(prefixes))
