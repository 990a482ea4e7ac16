"""torchao imported when a checkpoint needs it, not whenever transformers loads a model.

With torchao installed (quantized checkpoints), transformers' quantizer for it imports
torchao as the quantizers package is imported, which every model load does; torchao in
turn imports torch._dynamo, inductor, sympy and triton: about 85 MiB resident in every
engine process (the CPU bench's heterogeneous run peaked at 771 MiB with it), quantized
model or not. That module-level import serves one function, used only to save a torchao
model; the quantizer's loading methods import what they need from torchao themselves. So
transformers' availability check answers False while that one module is imported, and the
truth afterwards (a torchao checkpoint then loads as before, importing torchao on the way).
"""

from __future__ import annotations

import sys
from typing import Any


def defer() -> bool:
    """True when transformers' torchao quantizer was imported without torchao."""
    if "transformers.quantizers" in sys.modules:
        return False  # already imported: nothing to save
    try:
        import transformers.utils as utils
    except ImportError:
        return False
    real = utils.is_torchao_available  # type: ignore[attr-defined]
    deferring = True

    def is_torchao_available(*args: Any, **kwargs: Any) -> bool:
        return False if deferring else bool(real(*args, **kwargs))

    utils.is_torchao_available = is_torchao_available  # type: ignore[attr-defined]
    try:
        from transformers.quantizers import quantizer_torchao
    except ImportError:
        return False
    finally:
        deferring = False
        utils.is_torchao_available = real  # type: ignore[attr-defined]

    def flatten_tensor_state_dict(state_dict: Any) -> Any:
        from torchao.prototype.safetensors.safetensors_support import (
            flatten_tensor_state_dict as flatten,
        )

        return flatten(state_dict)

    # The one name the skipped import gave the module (saving a torchao model).
    if not hasattr(quantizer_torchao, "flatten_tensor_state_dict"):
        quantizer_torchao.flatten_tensor_state_dict = flatten_tensor_state_dict  # type: ignore[attr-defined]
    return True
