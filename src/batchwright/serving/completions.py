"""A finished job's Completion object (choices, logprobs, usage)."""

from __future__ import annotations

from typing import Any

from batchwright.engine.output.result import (
    LogprobsBuilder,
    TokenText,
    choice_text,
    logprob_tokens,
)
from batchwright.engine.requests.jobs import Decode, Job, Seq
from batchwright.protocol.completions import (
    Completion,
    CompletionChoice,
    CompletionUsage,
    PromptTokensDetails,
)


def _choice(
    job: Job, seq: Seq, index: int, decode: Decode, tok: TokenText, piece: TokenText
) -> CompletionChoice:
    req = job.req
    text = choice_text(seq, decode)
    echo = job.echo_texts[seq.prompt_index] if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        b = LogprobsBuilder(tok, piece, req.logprobs)
        if req.echo:
            b.add_prompt(job, seq.prompt_index)
            # Offsets of generated tokens continue after the echoed prompt text.
            b.pos = len(echo)
        for i in range(logprob_tokens(seq, text, piece)):
            b.add_generated(seq, i)
        logprobs = b.build()
    finish = seq.finish or "length"
    return CompletionChoice(
        finish_reason=finish,  # type: ignore[arg-type]
        index=index,
        logprobs=logprobs,
        text=echo + text,
    )


def build_completion(
    job: Job,
    *,
    model: str,
    fingerprint: str,
    decode: Decode,
    tok: TokenText,
    piece: TokenText | None = None,
) -> dict[str, Any]:
    """`tok`: a token as logprobs write it; `piece`: its decoded text (text_offset)."""
    req = job.req
    choices: list[CompletionChoice] = []
    for p in range(len(job.prompts)):
        cands = [s for s in job.seqs if s.prompt_index == p]
        if len(cands) > req.n:
            # best_of: the n candidates with the highest mean token logprob, best first.
            cands = sorted(cands, key=lambda s: (-s.score, s.cand))[: req.n]
        for j, seq in enumerate(cands):
            choices.append(_choice(job, seq, p * req.n + j, decode, tok, piece or tok))
    usage = result_usage(job)
    completion = Completion(
        id=job.id,
        choices=choices,
        created=job.created,
        model=model,
        system_fingerprint=fingerprint,
        usage=usage,
    )
    out: dict[str, Any] = completion.model_dump(mode="json")
    return out


def result_usage(job: Job) -> CompletionUsage:
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(s.out_ids) for s in job.seqs)
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(job.cached_tokens.values())),
    )
