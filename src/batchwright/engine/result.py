"""Turn a finished Job into the Completion object (choices, logprobs, usage)."""

from __future__ import annotations

from collections.abc import Callable

from batchwright.engine.jobs import Decode, Job, Seq
from batchwright.engine.types import GenResult
from batchwright.protocol.completions import (
    Completion,
    CompletionChoice,
    CompletionUsage,
    Logprobs,
    PromptTokensDetails,
)

TokenText = Callable[[int], str]


def _top_dict(
    top: list[tuple[int, float]], k: int, chosen: int, chosen_lp: float, tok: TokenText
) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid, lp in top[:k]:
        out.setdefault(tok(tid), lp)
    # OpenAI always includes the chosen token, so there may be k + 1 entries.
    out.setdefault(tok(chosen), chosen_lp)
    return out


class _LogprobsBuilder:
    def __init__(self, tok: TokenText, piece: TokenText, k: int) -> None:
        self.tok, self.piece, self.k = tok, piece, k
        self.tokens: list[str] = []
        self.lps: list[float | None] = []
        self.tops: list[dict[str, float] | None] = []
        self.offsets: list[int] = []
        self.pos = 0

    def add(self, tid: int, lp: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(self.tok(tid))
        self.lps.append(lp)
        self.tops.append(top)
        self.offsets.append(self.pos)
        self.pos += len(self.piece(tid))

    def build(self) -> Logprobs:
        return Logprobs(
            tokens=self.tokens,
            token_logprobs=self.lps,
            top_logprobs=self.tops,
            text_offset=self.offsets,
        )


def _choice(
    job: Job, seq: Seq, index: int, decode: Decode, tok: TokenText, piece: TokenText
) -> CompletionChoice:
    req = job.req
    gen_ids = seq.out_ids[:-1] if seq.ended_by_eos else list(seq.out_ids)
    text = decode(gen_ids)
    if seq.stop_at is not None:
        text = text[: seq.stop_at]
    echo = job.echo_texts[seq.prompt_index] if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        k = req.logprobs
        b = _LogprobsBuilder(tok, piece, k)
        if req.echo:
            prompt = job.prompts[seq.prompt_index]
            lps, tops = job.prompt_scores[seq.prompt_index]
            for i, tid in enumerate(prompt):
                top, lp = tops[i], lps[i]
                b.add(
                    tid, lp, None if top is None or lp is None else _top_dict(top, k, tid, lp, tok)
                )
            # Offsets of generated tokens continue after the echoed prompt text.
            b.pos = len(echo)
        start = b.pos
        for i, tid in enumerate(gen_ids):
            # Tokens past the stop sequence were generated but are not part of the text.
            if seq.stop_at is not None and b.pos - start >= len(text):
                break
            lp = seq.out_lps[i]
            b.add(tid, lp, _top_dict(seq.out_tops[i], k, tid, lp, tok))
        logprobs = b.build()
    finish = seq.finish or "length"
    return CompletionChoice(
        finish_reason=finish,  # type: ignore[arg-type]
        index=index,
        logprobs=logprobs,
        text=echo + text,
    )


def build_result(
    job: Job,
    *,
    model: str,
    fingerprint: str,
    decode: Decode,
    tok: TokenText,
    piece: TokenText | None = None,
) -> GenResult:
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
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(s.out_ids) for s in job.seqs)
    cached_tokens = sum(job.cached_tokens.values())
    usage = CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
    completion = Completion(
        id=job.id,
        choices=choices,
        created=job.created,
        model=model,
        system_fingerprint=fingerprint,
        usage=usage,
    )
    return GenResult(
        key=job.key,
        status_code=200,
        completion=completion.model_dump(mode="json"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )
