"""Deltas of streamed online requests: per engine step, what each choice gained.

A choice's delta holds the text that is safe to show (never part of a stop sequence,
never half a UTF-8 character: what may still become either is held back), the ids of
the tokens it covers, their logprobs with `text_offset` continuing from what was sent,
and, once, its finish_reason. The first delta of a choice is its echo alone (the prompt
text and, with logprobs, the prompt's scores: the choice's first chunk, as issue 23 asks),
followed in the same step by the first generated text; `token_ids` list generated tokens
only (relay/messages.py's ChoiceDelta). The last delta is cut from the finished
candidate exactly as result.py builds the Completion, so the deltas of a choice add up to
the choice a non-streamed request gets (text, tokens and logprobs alike).

A token's ids and logprobs go out once the text before it was sent: its offset (the
running length of the tokens decoded one at a time, as result.py counts `text_offset`)
lies inside the text sent. That is the rule result.py keeps tokens by at a stop
sequence, so what was streamed is always a prefix of the final lists.
"""

from __future__ import annotations

from typing import Literal, cast

from batchwright.engine.output.result import (
    LogprobsBuilder,
    choice_text,
    kept_tokens,
    logprob_tokens,
)
from batchwright.engine.requests.feed import Delta
from batchwright.engine.requests.jobs import Job, Seq
from batchwright.engine.text.text import Text
from batchwright.protocol.endpoints import CHAT

FinishReason = Literal["stop", "length"]


class ChoiceStream:
    """What one candidate sent so far."""

    def __init__(self, text: Text, job: Job, seq: Seq, index: int) -> None:
        self.text, self.job, self.seq, self.index = text, job, seq, index
        self.grown = text.text_stream()  # the generated text, decoded as it grows
        self.seen = 0  # generated tokens decoded into `grown`
        self.chars = 0  # characters of generated text sent
        self.tokens = 0  # generated tokens sent (ids, logprobs)
        self.pos = 0  # offset of the next generated token's text, counted as result.py does
        self.echoed = not job.req.echo
        self.done = False

    def deltas(self) -> list[Delta]:
        """What is new since the last call: the echo first, as a delta of its own (the
        choice's first chunk holds the prompt alone), then the new text, if any."""
        out = [] if self.echoed else [self._echo()]
        new = self.delta()
        return out if new is None else [*out, new]

    def _echo(self) -> Delta:
        job, seq, req = self.job, self.seq, self.job.req
        self.echoed = True
        lps = None
        if req.logprobs is not None:
            lps = LogprobsBuilder(self.text.token_text, self.text.token_piece, req.logprobs)
            lps.add_prompt(job, seq.prompt_index)
        return {
            "index": self.index,
            "text": job.echo_texts[seq.prompt_index],
            "token_ids": [],
            "logprobs": None if lps is None else lps.as_dict(),
            "finish_reason": None,
        }

    def delta(self) -> Delta | None:
        """What the generated text gained since the last delta, or None (the echo goes
        first, from `deltas`)."""
        if self.done:
            return None
        seq = self.seq
        if seq.finish is not None:
            self.done = True
            text = choice_text(seq, self.text.decode)
            finish = cast(FinishReason, seq.finish)
            # As the Completion lists them: a completion's EOS too, a chat's not
            # (serving/chat.py).
            listed = kept_tokens if self.job.endpoint == CHAT else logprob_tokens
            return self._delta(text, listed(seq, text, self.text.token_piece), finish)
        full = self._text()
        safe = full[: len(full) - seq.stop.held_back(full)] if seq.stop.stops else full
        # Tokens whose text starts inside what will have been sent.
        piece = self.text.token_piece
        tokens, pos = self.tokens, self.pos
        while tokens < len(seq.out_ids) and pos < len(safe):
            pos += len(piece(seq.out_ids[tokens]))
            tokens += 1
        if len(safe) == self.chars and tokens == self.tokens and self.echoed:
            return None
        return self._delta(safe, tokens, None)

    def _text(self) -> str:
        """The generated text so far without a trailing incomplete character (the stop
        checker keeps it already when the request has stop sequences)."""
        seq = self.seq
        if seq.stop.stops:
            return seq.stop.text
        if len(seq.out_ids) > self.seen:
            self.grown.update(seq.out_ids)
            self.seen = len(seq.out_ids)
        return self.grown.text

    def _delta(self, text: str, tokens: int, finish: FinishReason | None) -> Delta:
        """The delta up to `text` (the generated text sent once it goes) and `tokens`."""
        job, seq, req = self.job, self.seq, self.job.req
        ids = seq.out_ids[self.tokens : tokens]
        lps: LogprobsBuilder | None = None
        if req.logprobs is not None:
            lps = LogprobsBuilder(self.text.token_text, self.text.token_piece, req.logprobs)
        self.echoed = True
        base = len(job.echo_texts[seq.prompt_index]) if req.echo else 0
        if lps is not None:
            lps.pos = base + self.pos
            for i in range(self.tokens, tokens):
                lps.add_generated(seq, i)
            self.pos = lps.pos - base
        else:
            piece = self.text.token_piece
            self.pos += sum(len(piece(t)) for t in seq.out_ids[self.tokens : tokens])
        new = text[self.chars :]
        self.chars, self.tokens = len(text), tokens
        return {
            "index": self.index,
            "text": new,
            "token_ids": ids,
            "logprobs": None if lps is None else lps.as_dict(),
            "finish_reason": finish,
        }


class JobStream:
    """The choices of one streamed request, `index = prompt_index * n + candidate`.

    Only requests whose candidates are their choices stream (`best_of` > `n` picks the
    choices at the end: OpenAI refuses it with `stream`)."""

    def __init__(self, text: Text, job: Job) -> None:
        n = job.req.n
        self.choices = [ChoiceStream(text, job, s, s.prompt_index * n + s.cand) for s in job.seqs]
        self.finished = False  # every choice sent its finish_reason

    @staticmethod
    def streams(job: Job) -> bool:
        return job.req.candidates == job.req.n

    def deltas(self) -> list[Delta]:
        out = [d for c in self.choices for d in c.deltas()]
        if out:
            self.finished = all(c.done for c in self.choices)
        return out
