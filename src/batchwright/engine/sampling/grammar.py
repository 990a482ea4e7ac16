"""Structured outputs: `response_format` enforced by llguidance, one token bitmask a step.

Why llguidance and not xgrammar: both compile a JSON schema into a grammar and fill a
[rows, vocab / 32] int32 bitmask per step, but xgrammar requires triton on Linux x86_64
(a gigabyte installed on a CPU host, imported by torch._dynamo in every engine process
once present), where llguidance is one 8 MB wheel with no dependencies. llguidance
covers OpenAI's schema subset (patterns, enums, bounded arrays, nested objects, $defs)
and reports what it cannot compile; its grammar construction drops the GIL.

- `Grammars` (one per engine): the grammar library's view of the tokenizer, built on first
  use, and compiled grammars per distinct format (kind, canonical schema, strict) in a
  bounded LRU, each compiled once in a background thread: a line waiting for its grammar
  waits in the intake while others run (intake.py admits only lines whose grammar is ready;
  a grammar that fails answers its line with a 400 naming `response_format`). A compile
  has `GRAMMAR_COMPILE_SECONDS` from its request to its end: past that its lines get the
  400 (a compile cannot be stopped: it ends in its thread, unused, and at most
  `_COMPILERS` run at once). What the library says of a schema it refuses reaches the
  client; a panic of the library never does (it is logged).
- A row gets its own matcher (a copy of the compiled one) when it is admitted; it follows
  every token the row records (`Seq.push`) and, after each step, writes the row's allowed
  tokens for the next step into the sampler's host bitmask (`fill`), which the sampler
  copies to the device once per step and applies inside its fixed-shape core
  (sampler.py). Rows without a format have no matcher; steps without a constrained row
  take no bitmask at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

from batchwright.config import get_settings
from batchwright.protocol.response_format import ResponseFormat

log = logging.getLogger(__name__)

# Distinct formats whose compiled grammars are kept (each holds its lexer and parser
# tables; a dataset job uses a handful).
CACHE_SIZE = 64
# Compact JSON: whitespace between tokens is only a way for a model to run out of tokens.
_OPTIONS: Any = {"whitespace_flexible": False}
# Compiles running at once (each holds a core while it runs; one past its time limit runs
# on, unused, until it ends).
_COMPILERS = 2


class GrammarError(ValueError):
    """The format cannot be compiled: the line's 400 naming `response_format`."""


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: an object schema that does not say otherwise takes no
    properties beyond those it lists."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or (
        isinstance(out.get("type"), list) and "object" in out["type"]
    )
    if is_object and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_source(fmt: ResponseFormat) -> str:
    """The llguidance grammar of a constrained format."""
    from llguidance import LLMatcher

    schema: Any = {"type": "object"}
    spec = fmt.json_schema if fmt.type == "json_schema" else None
    if spec is not None and spec.schema_ is not None:
        schema = strict_schema(spec.schema_) if spec.strict else spec.schema_
    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=_OPTIONS))
    except Exception as exc:  # the library's ValueError/RuntimeError on what it refuses
        raise GrammarError(str(exc)) from None
    except BaseException as exc:  # a panic of the library (pyo3's PanicException)
        raise _panicked(exc) from None


def _panicked(exc: BaseException) -> GrammarError:
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        raise exc
    log.error("the grammar library failed on a schema: %s: %s", type(exc).__name__, exc)
    return GrammarError("the grammar library failed on this schema")


class Grammars:
    """Compiled grammars of one engine's tokenizer, compiled off the decode loop."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: frozenset[int],
        time_limit: float | None = None,
    ) -> None:
        self._hf = tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._tok: Any = None
        self._tok_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_COMPILERS)
        self._cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        # Requests come from the threads that prepare lines (serving/prepare.py).
        self._lock = threading.Lock()
        if time_limit is None:
            time_limit = get_settings().grammar_compile_seconds
        self.time_limit = time_limit
        self.compiled = 0  # grammars compiled (tests: once per distinct format)

    def request(self, fmt: ResponseFormat | None) -> Future[Any] | None:
        """The compiled grammar of `fmt` (a future: ready at once when cached), or None
        for text. A compile that failed or ran out of time stays failed in the cache: the
        same schema again is refused at once, not compiled again."""
        key = fmt.grammar_key() if fmt is not None else None
        if key is None or fmt is None:
            return None
        with self._lock:
            return self._request(key, fmt)

    def _request(self, key: tuple[str, str, bool], fmt: ResponseFormat) -> Future[Any]:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        future: Future[Any] = Future()
        lock = threading.Lock()
        threading.Thread(
            target=self._run, args=(future, lock, fmt), daemon=True, name="grammar"
        ).start()
        if self.time_limit > 0:
            timer = threading.Timer(self.time_limit, self._expire, args=(future, lock))
            timer.daemon = True
            timer.start()
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _run(self, future: Future[Any], lock: threading.Lock, fmt: ResponseFormat) -> None:
        with self._slots:
            if future.done():
                return  # its time ran out while it waited for a compiler
            try:
                result: Any = self._compile(fmt)
                error: BaseException | None = None
            except GrammarError as exc:
                result, error = None, exc
            except BaseException as exc:
                result, error = None, _panicked(exc)
        with lock:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _expire(self, future: Future[Any], lock: threading.Lock) -> None:
        with lock:
            if not future.done():
                future.set_exception(
                    GrammarError(
                        f"it did not compile within {self.time_limit:g} s "
                        "(BATCHWRIGHT_GRAMMAR_COMPILE_SECONDS); simplify the schema (fewer "
                        "optional properties, enums or alternatives)"
                    )
                )

    def _compile(self, fmt: ResponseFormat) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        with self._tok_lock:
            if self._tok is None:
                from llguidance.hf import from_tokenizer

                self._tok = from_tokenizer(self._hf, n_vocab=self._vocab, eos_token=self._eos)
        # verbose_errors off: an error says what is wrong, not the parser's state.
        limits = LLParserLimits(verbose_errors=False)
        started = time.perf_counter()
        matcher = LLMatcher(self._tok, grammar_source(fmt), log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        log.debug("grammar compiled in %.3f s", time.perf_counter() - started)
        self.compiled += 1
        return matcher

    def close(self) -> None:
        """Nothing to stop: compiles end in their threads."""


def grammar_error(future: Future[Any]) -> str | None:
    """Why a finished compile failed (the 400's message), or None."""
    exc = future.exception()
    if exc is None:
        return None
    detail = " ".join(str(exc).split())[:300] or type(exc).__name__
    return (
        f"Invalid 'response_format': the JSON schema cannot be enforced: {detail}. "
        "batchwright supports the JSON Schema subset of OpenAI's structured outputs."
    )


def new_matcher(future: Future[Any]) -> Any:
    """A row's own matcher: a copy of the compiled one, at the start of the grammar."""
    return future.result().deep_copy()


def fill(mask: torch.Tensor, rows: Iterable[tuple[int, Any]]) -> None:
    """Write each (row, matcher)'s allowed next tokens into `mask` [rows, words] (int32,
    on the host, rows contiguous), bit t of a row set when token t may come next."""
    width = mask.shape[1] * 4
    base = mask.data_ptr()
    stride = mask.stride(0) * 4
    for row, matcher in rows:
        matcher.unsafe_compute_mask_ptr(base + row * stride, width)


class RowGrammars:
    """The scheduler's side: a matcher per constrained row, its bitmask row kept current."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def start(self, slots: list[int], seqs: list[Any]) -> None:
        """Rows just admitted into `slots`: their matchers, and their first token's mask."""
        rows = []
        for slot, seq in zip(slots, seqs, strict=True):
            if seq.job.grammar is not None:
                seq.matcher = new_matcher(seq.job.grammar)
                rows.append((slot, seq.matcher))
        if rows:
            self.sampler.constrain([r for r, _ in rows])
            fill(self.sampler.host_mask, rows)

    def next(self, rows: Iterable[tuple[int, Any]]) -> None:
        """After a step: the masks of the next step for the rows still running."""
        if not self.sampler.masked(self.sampler.capacity):
            return  # no constrained row anywhere: nothing to look at
        fill(self.sampler.host_mask, [(i, q.matcher) for i, q in rows if q.matcher is not None])
