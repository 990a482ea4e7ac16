"""Lines into requests the engine takes: parsed, validated against the model, tokenized.

A Preparer belongs to a loaded model (its tokenizer, chat template, vocabulary and
context; `preparer(engine)`, one per engine) and is called off the engine's thread, by
whatever reads lines for it (the worker's claim read-ahead, its lease-process reader, the
online taker; lines.py for callers without a thread of their own): the engine never
parses a body or tokenizes a prompt. A line the model must refuse becomes its
GenResult(400) here, and reaches the engine as such, in its place among the lines (a
result like any other, yielded when the engine reads it).
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from batchwright.engine.requests.jobs import Decode, bad_request, server_error
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.protocol.completions import check_completion_body
from batchwright.protocol.endpoints import CHAT, COMPLETIONS, endpoint_of
from batchwright.serving.chat_prompt import prepare_chat
from batchwright.serving.tokenize import counted, tokenize
from batchwright.serving.validated import request_of

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine

log = logging.getLogger(__name__)

# The compile of a response_format (sampling/grammar.py's Grammars.request).
GrammarFor = Callable[[Any], "Future[Any] | None"]
# The read of a LoRA adapter's weights by name (engine/lora/store.py's request).
AdapterFor = Callable[[str], "Future[Any]"]


class Preparer:
    """`prepare(line)`: the line's EngineRequest, or the GenResult(400) the model answers.

    Called from several threads (a lease's reader, the online taker): one line at a
    time, on a tokenizer of its own. A fast tokenizer's Rust side is borrowed mutably when
    its truncation is set, and a decode on the engine's thread borrowing it meanwhile
    fails ("Already borrowed"): the engine's copy only ever decodes."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        chat_template: str | None,
        model: str,
        decode: Decode,
        vocab_size: int,
        context_length: int,
        eos_ids: frozenset[int],
        grammar: GrammarFor,
        adapter: AdapterFor | None = None,
    ) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self.chat_template = chat_template
        self.model = model
        self.decode = decode
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_ids = eos_ids
        self.grammar = grammar
        self.adapter = adapter  # None: this model's workers serve no adapters

    def __call__(self, line: GenRequest) -> EngineRequest | GenResult:
        with self._lock:
            try:
                return self._prepare(line)
            except Exception as exc:
                # This line's failure, not its run's (a text that cannot be tokenized):
                # a 500 for it alone, the exception's type only (logged whole here).
                log.exception("line %s: preparing it failed", line.key)
                return server_error(line.key, exc)

    def _prepare(self, line: GenRequest) -> EngineRequest | GenResult:
        if line.adapter is not None and self.adapter is None:
            return bad_request(
                line.key,
                f"The model '{line.adapter[:200]}' is an adapter of '{self.model}', "
                "whose workers serve no adapters (max_loras 0).",
                "model",
                "model_not_found",
            )
        if endpoint_of(line.body) == CHAT:
            out = prepare_chat(
                line,
                self.tokenizer,
                self.chat_template,
                self.model,
                vocab_size=self.vocab_size,
                context_length=self.context_length,
            )
        else:
            out = self._completion(line)
        if isinstance(out, EngineRequest):
            # Compiled off the loop; the intake admits the request once it is ready.
            out.grammar = self.grammar(out.response_format)
            if out.adapter is not None and self.adapter is not None:
                out.lora = self.adapter(out.adapter)  # read off the loop too
        return out

    def _completion(self, line: GenRequest) -> EngineRequest | GenResult:
        """Parse and tokenize one /v1/completions line."""
        req, err = check_completion_body(line.body)
        if err is not None or req is None:
            return GenResult(key=line.key, status_code=400, error=err)
        context = self.context_length
        raw = req.prompt
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif all(isinstance(x, int) for x in raw):
            items = [[int(x) for x in raw]]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        prompts: list[list[int]] = []
        echo_texts: list[str] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                ids = tokenize(self.tokenizer, item, context)
                if not ids:
                    # OpenAI: an empty prompt generates as if from the start of a document.
                    start = self.tokenizer.bos_token_id
                    ids = [start if start is not None else min(self.eos_ids, default=0)]
                echo_texts.append(item)
            else:
                bad = [t for t in item if t >= self.vocab_size]
                if bad:
                    return bad_request(
                        line.key,
                        f"Invalid token id {bad[0]} in prompt {i}: the model's vocabulary "
                        f"has {self.vocab_size} tokens (ids 0 to {self.vocab_size - 1}).",
                        "prompt",
                        "invalid_prompt",
                    )
                ids = list(item)
                echo_texts.append(self.decode(ids))
            if len(ids) + req.max_tokens > context:
                return bad_request(
                    line.key,
                    f"This model's maximum context length is {context} tokens, however you "
                    f"requested {_total(ids, req.max_tokens, context)} tokens "
                    f"({counted(ids, context)} in your prompt; {req.max_tokens} for the "
                    "completion). Please reduce your prompt; or completion length.",
                    "max_tokens",
                    "context_length_exceeded",
                )
            prompts.append(ids)
        return request_of(
            line, req, prompts, echo_texts, vocab_size=self.vocab_size, endpoint=COMPLETIONS
        )


def _total(ids: list[int], max_tokens: int, context: int) -> str:
    if len(ids) > context:  # cut by `tokenize`: a lower bound
        return f"more than {context + max_tokens}"
    return str(len(ids) + max_tokens)


Prepare = Callable[[GenRequest], EngineRequest | GenResult]

# One preparer per engine (each holds a copy of the tokenizer), for as long as the engine.
_preparers: weakref.WeakKeyDictionary[Engine, Preparer] = weakref.WeakKeyDictionary()
_preparers_lock = threading.Lock()


def preparer(engine: Engine) -> Preparer:
    """The preparer of `engine`'s model, built at the first call."""
    with _preparers_lock:
        prepare = _preparers.get(engine)
        if prepare is None:
            prepare = _preparers[engine] = _new_preparer(engine)
        return prepare


def preparer_for(engine: Any) -> Preparer | None:
    """`preparer(engine)` for a generation engine; None for one that takes lines as they
    are (an embedding model's runner, a test's stand-in)."""
    # Not imported at the top: a torch-free importer of this module loads no engine.
    from batchwright.engine.engine import Engine

    return preparer(engine) if isinstance(engine, Engine) else None


def _new_preparer(engine: Engine) -> Preparer:
    lm = engine.lm
    lora = engine.lora
    return Preparer(
        tokenizer=lm.tokenizer,
        chat_template=lm.chat_template,
        model=engine.model_name,
        decode=engine.text.decode,
        vocab_size=lm.vocab_size,
        context_length=lm.context_length,
        eos_ids=lm.eos_ids,
        grammar=engine.grammars.request,
        adapter=lora.store.request if lora is not None else None,
    )
