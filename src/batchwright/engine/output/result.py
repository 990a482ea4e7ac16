"""What a finished candidate's choice holds: its text, the tokens its logprobs list and
their entries (the Completion's shape, which stream deltas share). The wire objects are
built from them outside the engine (batchwright/serving)."""

from __future__ import annotations

from collections.abc import Callable

from batchwright.engine.requests.jobs import Decode, Job, Seq
from batchwright.protocol.completions import Logprobs
from batchwright.relay.messages import DeltaLogprobs

TokenText = Callable[[int], str]


def top_dict(
    top: list[tuple[int, float]], k: int, chosen: int, chosen_lp: float, tok: TokenText
) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid, lp in top[:k]:
        out.setdefault(tok(tid), lp)
    # OpenAI always includes the chosen token, so there may be k + 1 entries.
    out.setdefault(tok(chosen), chosen_lp)
    return out


class LogprobsBuilder:
    """Logprobs entries in order; `pos` is the text offset of the next one."""

    def __init__(self, tok: TokenText, piece: TokenText, k: int, pos: int = 0) -> None:
        self.tok, self.piece, self.k = tok, piece, k
        self.tokens: list[str] = []
        self.lps: list[float | None] = []
        self.tops: list[dict[str, float] | None] = []
        self.offsets: list[int] = []
        self.pos = pos

    def add(self, tid: int, lp: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(self.tok(tid))
        self.lps.append(lp)
        self.tops.append(top)
        self.offsets.append(self.pos)
        self.pos += len(self.piece(tid))

    def add_prompt(self, job: Job, prompt_index: int) -> None:
        """The prompt's tokens with their scores (echo with logprobs; the first None)."""
        lps, tops = job.prompt_scores[prompt_index]
        for i, tid in enumerate(job.prompts[prompt_index]):
            top, lp = tops[i], lps[i]
            t = None if top is None or lp is None else top_dict(top, self.k, tid, lp, self.tok)
            self.add(tid, lp, t)

    def add_generated(self, seq: Seq, index: int) -> None:
        tid, lp = seq.out_ids[index], seq.out_lps[index]
        self.add(tid, lp, top_dict(seq.out_tops[index], self.k, tid, lp, self.tok))

    def as_dict(self) -> DeltaLogprobs:
        """The entries as Logprobs' JSON, without building the model (per-step deltas)."""
        return {
            "tokens": self.tokens,
            "token_logprobs": self.lps,
            "top_logprobs": self.tops,
            "text_offset": self.offsets,
        }

    def build(self) -> Logprobs:
        return Logprobs(
            tokens=self.tokens,
            token_logprobs=self.lps,
            top_logprobs=self.tops,
            text_offset=self.offsets,
        )


def generated_ids(seq: Seq) -> list[int]:
    """The tokens a choice's text comes from (its EOS left out)."""
    return seq.out_ids[:-1] if seq.ended_by_eos else list(seq.out_ids)


def choice_text(seq: Seq, decode: Decode) -> str:
    """A finished candidate's generated text (before its stop sequence)."""
    text = decode(generated_ids(seq))
    return text[: seq.stop_at] if seq.stop_at is not None else text


def kept_tokens(seq: Seq, text: str, piece: TokenText) -> int:
    """Generated tokens listed in a finished candidate's logprobs: all but its EOS, and
    with a stop sequence those that start inside `text` (tokens past it were generated but
    are not part of the text)."""
    ids = generated_ids(seq)
    if seq.stop_at is None:
        return len(ids)
    pos = 0
    for i, tid in enumerate(ids):
        if pos >= len(text):
            return i
        pos += len(piece(tid))
    return len(ids)


def logprob_tokens(seq: Seq, text: str, piece: TokenText) -> int:
    """Generated tokens listed in a finished completion choice's logprobs: the kept ones,
    and its EOS last, as OpenAI lists "<|endoftext|>" (its text is empty). A scorer that
    asks for one token with echo drops the last entry as the generated one: without the
    EOS there it dropped a prompt token instead."""
    kept = kept_tokens(seq, text, piece)
    return kept + 1 if seq.ended_by_eos and kept == len(seq.out_ids) - 1 else kept
