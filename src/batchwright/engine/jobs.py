"""Requests as the scheduler sees them: a Job per GenRequest, a Seq per generated candidate."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchwright.engine.sampling import RowParams
from batchwright.engine.stop import StopChecker
from batchwright.engine.types import GenRequest, GenResult
from batchwright.protocol.completions import CompletionRequest, check_completion_body

Decode = Callable[[list[int]], str]
# Per prompt position: (logprob or None for the first token, top-k [(id, logprob)] or None).
PromptScores = tuple[list[float | None], list[list[tuple[int, float]] | None]]


def bad_request(key: Any, message: str, param: str | None, code: str | None) -> GenResult:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return GenResult(key=key, status_code=400, error=error)


def server_error(key: Any, exc: BaseException) -> GenResult:
    """The 500 of one request the engine failed on (its other requests run on): the
    exception's type, never its text (the caller logs it whole)."""
    error = {
        "message": f"The engine failed on this request ({type(exc).__name__}).",
        "type": "server_error",
        "param": None,
        "code": "engine_error",
    }
    return GenResult(key=key, status_code=500, error=error)


@dataclass(eq=False)
class Seq:
    """One candidate completion of one prompt: a row of the decode batch while it runs."""

    job: Job
    prompt_index: int
    cand: int
    params: RowParams
    stop: StopChecker
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    stop_at: int | None = None  # char index of the stop sequence in the generated text
    ended_by_eos: bool = False
    matcher: Any = None  # the row's grammar matcher when its request has a response_format

    @property
    def prompt(self) -> list[int]:
        return self.job.prompts[self.prompt_index]

    def push(self, token: int, logprob: float, top: list[tuple[int, float]] | None) -> bool:
        """Record a generated token; True when this candidate is finished."""
        self.out_ids.append(token)
        self.out_lps.append(logprob)
        if self.matcher is not None:
            self.matcher.consume_token(token)
        if top is not None:
            self.out_tops.append(top)
        job = self.job
        if token in job.eos_ids:
            self.finish, self.ended_by_eos = "stop", True
        elif (at := self.stop.check(self.out_ids)) is not None:
            self.finish, self.stop_at = "stop", at
        elif len(self.out_ids) >= min(job.req.max_tokens, job.context_length - len(self.prompt)):
            # max_tokens reached, or the context is full: either way "length".
            self.finish = "length"
        if self.finish is not None:
            job.remaining -= 1
            return True
        return False

    @property
    def score(self) -> float:
        """best_of ranking: mean logprob of every token this candidate generated."""
        return sum(self.out_lps) / len(self.out_lps) if self.out_lps else 0.0


@dataclass(eq=False)
class Job:
    key: Any
    req: CompletionRequest
    prompts: list[list[int]]
    echo_texts: list[str]
    eos_ids: frozenset[int]
    context_length: int
    seqs: list[Seq] = field(default_factory=list)
    remaining: int = 0
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)
    # Prompt tokens served from the prefix cache, per prompt, at its first prefill.
    cached_tokens: dict[int, int] = field(default_factory=dict)
    group: Any = None  # GenRequest.group
    online: bool = False  # ahead of batch lines, never preempted (engine/online.py)
    admitted: int = 0  # the admission round of its latest rows (youngest are preempted first)
    requeued: bool = False  # preempted: back at the front of the waiting lines
    chat: Any = None  # a chat line's ChatCompletionRequest (engine/chat.py); `req` runs it
    grammar: Any = None  # Future of the compiled response_format (grammar.py), if any
    adapter: str | None = None  # GenRequest.adapter (engine/lora/)
    lora: Any = None  # Future of the adapter's weights (engine/lora/store.py), if any
    adapter_key: Any = None  # the adapter's slot and prefix-cache key once admitted
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_urlsafe(18))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def done(self) -> bool:
        return self.remaining == 0

    @property
    def needs_prompt_scores(self) -> bool:
        return self.req.echo and self.req.logprobs is not None


def row_rng(seed: int | None, prompt_index: int, cand: int) -> random.Random:
    if seed is None:
        return random.Random(secrets.randbits(64))
    # A string seed is hashed with SHA-512 by `random`: stable across processes and hosts.
    return random.Random(f"{seed}:{prompt_index}:{cand}")


def prepare(
    greq: GenRequest,
    tokenizer: Any,
    decode: Decode,
    *,
    vocab_size: int,
    context_length: int,
    eos_ids: frozenset[int],
) -> Job | GenResult:
    """Parse and tokenize one request; a GenResult(400) when the model must reject it."""
    req, err = check_completion_body(greq.body)
    if err is not None or req is None:
        return GenResult(key=greq.key, status_code=400, error=err)
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
            ids = list(tokenizer(item).input_ids)
            if not ids:
                # OpenAI: an empty prompt generates as if from the start of a new document.
                start = tokenizer.bos_token_id
                ids = [start if start is not None else min(eos_ids, default=0)]
            echo_texts.append(item)
        else:
            bad = [t for t in item if t >= vocab_size]
            if bad:
                return bad_request(
                    greq.key,
                    f"Invalid token id {bad[0]} in prompt {i}: the model's vocabulary has "
                    f"{vocab_size} tokens (ids 0 to {vocab_size - 1}).",
                    "prompt",
                    "invalid_prompt",
                )
            ids = list(item)
            echo_texts.append(decode(ids))
        total = len(ids) + req.max_tokens
        if total > context_length:
            return bad_request(
                greq.key,
                f"This model's maximum context length is {context_length} tokens, however you "
                f"requested {total} tokens ({len(ids)} in your prompt; {req.max_tokens} for the "
                "completion). Please reduce your prompt; or completion length.",
                "max_tokens",
                "context_length_exceeded",
            )
        prompts.append(ids)
    return build_job(
        greq,
        req,
        prompts,
        echo_texts,
        decode,
        vocab_size=vocab_size,
        context_length=context_length,
        eos_ids=eos_ids,
    )


def build_job(
    greq: GenRequest,
    req: CompletionRequest,
    prompts: list[list[int]],
    echo_texts: list[str],
    decode: Decode,
    *,
    vocab_size: int,
    context_length: int,
    eos_ids: frozenset[int],
) -> Job | GenResult:
    """The job of a request whose prompts are tokenized (a chat line's: rendered)."""
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        if int(k) >= vocab_size:
            return bad_request(
                greq.key,
                f"Invalid 'logit_bias': token id {k} is outside the model's vocabulary "
                f"(ids 0 to {vocab_size - 1}).",
                "logit_bias",
                None,
            )
        bias[int(k)] = v
    job = Job(
        greq.key,
        req,
        prompts,
        echo_texts,
        eos_ids,
        context_length,
        group=greq.group,
        adapter=greq.adapter,
    )
    stops = req.stop_list
    if req.max_tokens > 0:
        for p in range(len(prompts)):
            for c in range(req.candidates):
                params = RowParams(
                    temperature=req.temperature,
                    top_p=req.top_p,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    logit_bias=bias,
                    logprobs=req.logprobs,
                    rng=row_rng(req.seed, p, c),
                )
                job.seqs.append(Seq(job, p, c, params, StopChecker(stops, decode)))
    else:
        # Nothing to generate: one empty candidate per choice, finished by "length".
        for p in range(len(prompts)):
            for c in range(req.n):
                params = RowParams(1.0, 1.0, 0.0, 0.0, {}, None, random.Random(0))
                job.seqs.append(Seq(job, p, c, params, StopChecker([], decode), finish="length"))
    job.remaining = sum(1 for s in job.seqs if s.finish is None)
    return job
