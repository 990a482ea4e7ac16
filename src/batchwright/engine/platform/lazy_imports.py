"""Libraries transformers imports for work an engine never does, imported when that work
comes instead of in every engine process.

transformers asks `is_X_available()` at import time and, where it answers True, imports X
at module level for one function. Two of these cost an engine process memory it never
uses (peak RSS of the CPU bench's heterogeneous run, docs/engine.md):

- torchao (quantized checkpoints): its quantizer imports it as the quantizers package is
  imported, which every model load does; torchao in turn imports torch._dynamo, inductor,
  sympy and triton, about 85 MiB. That import serves one function, used only to save a
  torchao model; the quantizer's loading methods import what they need themselves.
- scipy (training losses): the object-detection losses, which modeling_utils imports
  through its loss table, import `scipy.optimize.linear_sum_assignment` for their
  matching, about 39 MiB (scipy is there wherever sentence-transformers is).

So the availability check answers False while those modules are imported, and the truth
afterwards; the one name each skipped import gave its modules is put back as a function
that imports it at its first call (saving a torchao model, training a detector).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def _unavailable(check: str) -> Iterator[None]:
    """transformers.utils.`check`() answers False inside the block, the truth after it
    (modules imported inside keep the wrapper: they get the truth when they call it)."""
    import transformers.utils as utils

    real = getattr(utils, check)
    deferring = True

    def answer(*args: Any, **kwargs: Any) -> bool:
        return False if deferring else bool(real(*args, **kwargs))

    setattr(utils, check, answer)
    try:
        yield
    finally:
        deferring = False
        setattr(utils, check, real)


def _torchao() -> bool:
    if "transformers.quantizers" in sys.modules:
        return False  # already imported: nothing to save
    with _unavailable("is_torchao_available"):
        from transformers.quantizers import quantizer_torchao

    def flatten_tensor_state_dict(state_dict: Any) -> Any:
        from torchao.prototype.safetensors.safetensors_support import (
            flatten_tensor_state_dict as flatten,
        )

        return flatten(state_dict)

    if not hasattr(quantizer_torchao, "flatten_tensor_state_dict"):
        quantizer_torchao.flatten_tensor_state_dict = flatten_tensor_state_dict  # type: ignore[attr-defined]
    return True


def _scipy() -> bool:
    if "transformers.loss.loss_utils" in sys.modules:
        return False
    with _unavailable("is_scipy_available"):
        import transformers.loss.loss_utils  # noqa: F401

    def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
        from scipy.optimize import linear_sum_assignment as solve

        return solve(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (
            name.startswith("transformers.loss.")
            and hasattr(module, "is_scipy_available")
            and not hasattr(module, "linear_sum_assignment")
        ):
            module.linear_sum_assignment = linear_sum_assignment  # type: ignore[attr-defined]
    return True


def defer() -> list[str]:
    """What is deferred (those not installed, or imported already, are not)."""
    try:
        import transformers.utils  # noqa: F401
    except ImportError:
        return []
    deferred = []
    for name, step in (("torchao", _torchao), ("scipy", _scipy)):
        try:
            if step():
                deferred.append(name)
        except ImportError:
            pass
    return deferred
