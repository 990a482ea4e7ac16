"""Requests as the scheduler sees them: a Job per request, a Seq per generated candidate, a
Unit per prompt admitted (its candidates, prefilled once)."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchwright.engine.requests.request import EngineRequest, Sampling
from batchwright.engine.requests.types import GenResult
from batchwright.engine.sampling.params import RowParams
from batchwright.engine.text.stop import GrowingText, StopChecker

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
    # The most tokens it may generate, from the KV manager as it places the candidate
    # (kv/manager.py's max_new, the blocks it reserves); None until placed.
    max_new: int | None = None

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
        elif self.max_new is not None and len(self.out_ids) >= self.max_new:
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
    req: Sampling
    prompts: list[list[int]]
    echo_texts: list[str]
    eos_ids: frozenset[int]
    seqs: list[Seq] = field(default_factory=list)
    remaining: int = 0
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)
    # Prompt tokens served from the prefix cache, per prompt, at its first prefill.
    cached_tokens: dict[int, int] = field(default_factory=dict)
    group: Any = None  # GenRequest.group
    online: bool = False  # ahead of batch lines, never preempted (scheduling/lane.py)
    admitted: int = 0  # the admission round of its latest rows (youngest are preempted first)
    requeued: bool = False  # preempted: back at the front of the waiting lines
    endpoint: str = "/v1/completions"  # the wire object its result becomes (EngineRequest)
    grammar: Any = None  # Future of the compiled response_format (sampling/grammar.py)
    adapter: str | None = None  # the LoRA adapter it runs under (engine/lora/), or None
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

    def result(self) -> GenResult:
        """The finished job's result: its usage counted, and the job itself for whoever
        builds the wire object (batchwright/serving)."""
        return GenResult(
            key=self.key,
            status_code=200,
            prompt_tokens=sum(len(p) for p in self.prompts),
            completion_tokens=sum(len(s.out_ids) for s in self.seqs),
            cached_tokens=sum(self.cached_tokens.values()),
            job=self,
        )


def row_rng(seed: int | None, prompt_index: int, cand: int) -> random.Random:
    if seed is None:
        return random.Random(secrets.randbits(64))
    # A string seed is hashed with SHA-512 by `random`: stable across processes and hosts.
    return random.Random(f"{seed}:{prompt_index}:{cand}")


def start(
    request: EngineRequest,
    decode: Decode,
    eos_ids: frozenset[int],
    grow: Callable[[], GrowingText] | None = None,
) -> Job:
    """The job of a validated request, with a candidate per choice to generate (or, with
    nothing to generate, one empty candidate per choice, finished by "length")."""
    req = request.sampling
    job = Job(
        request.key,
        req,
        request.prompts,
        request.echo_texts,
        eos_ids,
        group=request.group,
        endpoint=request.endpoint,
        grammar=request.grammar,
        adapter=request.adapter,
        lora=request.lora,
    )
    prompts = request.prompts
    if req.max_tokens > 0:
        for p in range(len(prompts)):
            for c in range(req.candidates):
                params = RowParams(
                    temperature=req.temperature,
                    top_p=req.top_p,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    logit_bias=req.logit_bias,
                    logprobs=req.logprobs,
                    rng=row_rng(req.seed, p, c),
                )
                job.seqs.append(Seq(job, p, c, params, StopChecker(req.stop_list, decode, grow)))
    else:
        for p in range(len(prompts)):
            for c in range(req.n):
                params = RowParams(1.0, 1.0, 0.0, 0.0, {}, None, random.Random(0))
                job.seqs.append(Seq(job, p, c, params, StopChecker([], decode), finish="length"))
    job.remaining = sum(1 for s in job.seqs if s.finish is None)
    return job


@dataclass(eq=False)
class Unit:
    """Candidates of one prompt admitted together: the prompt is prefilled once for all."""

    job: Job
    prompt_index: int
    seqs: list[Seq]

    @property
    def prompt(self) -> list[int]:
        return self.job.prompts[self.prompt_index]


def units_of(job: Job) -> list[Unit]:
    """A unit per prompt of `job`, with that prompt's candidates."""
    return [
        Unit(job, p, [s for s in job.seqs if s.prompt_index == p]) for p in range(len(job.prompts))
    ]
