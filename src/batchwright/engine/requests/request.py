"""What the engine takes: a line validated and tokenized (serving/prepare.py)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class Sampling:
    """A request's generation parameters, validated: the engine checks none of them again.
    `candidates` is best_of (or n); `logit_bias` ids lie inside the vocabulary."""

    max_tokens: int
    n: int
    candidates: int
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    logprobs: int | None  # top-k wanted per position; None: no logprobs
    echo: bool
    stop_list: list[str]
    seed: int | None


@dataclass(eq=False)
class EngineRequest:
    """What the engine takes: a line validated and tokenized (serving/prepare.py).

    `prompts` are token ids (a completion's prompts, or a chat line's rendered messages),
    `echo_texts` their text as an echo returns it, `endpoint` the path whose object the
    result becomes (built outside the engine), `grammar` the compile of its
    response_format (a future; None without one). `key`, `group` and `stream` are the
    GenRequest's.
    """

    key: Any
    prompts: list[list[int]]
    echo_texts: list[str]
    sampling: Sampling
    endpoint: str
    group: Any = None
    stream: bool = False
    response_format: Any = None  # protocol's ResponseFormat, or None for text
    grammar: Future[Any] | None = None
    # The LoRA adapter it runs under (GenRequest.adapter) and the read of its weights (a
    # future, engine/lora/store.py); None for the model itself.
    adapter: str | None = None
    lora: Future[Any] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)
