"""A finished chat job's chat.completion object (message, chat logprobs, usage)."""

from __future__ import annotations

from typing import Any

from batchwright.engine.output.result import (
    TokenText,
    choice_text,
    generated_ids,
    kept_tokens,
)
from batchwright.engine.requests.jobs import Decode, Job
from batchwright.protocol.chat import (
    ChatChoice,
    ChatCompletion,
    ChatMessage,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
    chat_id,
)
from batchwright.serving.completions import result_usage

TokenBytes = Any  # Callable[[int], bytes | None]


def _logprobs(
    job: Job, seq_index: int, text: str, tok: TokenText, piece: TokenText, raw: TokenBytes
) -> ChoiceLogprobs:
    seq = job.seqs[seq_index]
    k = job.req.logprobs or 0

    def bytes_of(tid: int) -> list[int]:
        b = raw(tid)
        return list(b if b is not None else piece(tid).encode("utf-8"))

    ids = generated_ids(seq)
    content: list[TokenLogprob] = []
    for i in range(kept_tokens(seq, text, piece)):
        tid = ids[i]
        tops = [
            TopLogprob(token=tok(t), logprob=lp, bytes=bytes_of(t)) for t, lp in seq.out_tops[i][:k]
        ]
        content.append(
            TokenLogprob(
                token=tok(tid), logprob=seq.out_lps[i], bytes=bytes_of(tid), top_logprobs=tops
            )
        )
    return ChoiceLogprobs(content=content, refusal=None)


def build_chat_completion(
    job: Job,
    *,
    model: str,
    fingerprint: str,
    decode: Decode,
    tok: TokenText,
    piece: TokenText,
    raw: TokenBytes,
) -> dict[str, Any]:
    choices: list[ChatChoice] = []
    for index, seq in enumerate(job.seqs):
        text = choice_text(seq, decode)
        logprobs = None
        if job.req.logprobs is not None:
            logprobs = _logprobs(job, index, text, tok, piece, raw)
        choices.append(
            ChatChoice(
                finish_reason=seq.finish or "length",  # type: ignore[arg-type]
                index=index,
                logprobs=logprobs,
                message=ChatMessage(content=text),
            )
        )
    usage = result_usage(job)
    completion = ChatCompletion(
        id=chat_id(job.id),
        choices=choices,
        created=job.created,
        model=model,
        system_fingerprint=fingerprint,
        usage=usage,
    )
    out: dict[str, Any] = completion.model_dump(mode="json")
    return out
