"""The output processor: what a step's tokens make of the requests.

Each token a step sampled goes to its candidate (`Seq.push`: the text grows, stops and
EOS are matched, the grammar advances); a candidate that finished leaves its row, and a
request whose candidates all finished is a result. After each step every streamed request
whose choices gained something gets one delta (`feed.emit`), before the step's results
go out: a request's last delta always comes before its result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from batchwright.engine.output.streaming import JobStream
from batchwright.engine.requests.feed import LaneFeed
from batchwright.engine.requests.jobs import Job, Seq
from batchwright.engine.requests.types import GenResult
from batchwright.engine.sampling.params import StepOut
from batchwright.engine.text.text import Text


class OutputProcessor:
    """One run's outputs: results of finished jobs and the streams of online requests."""

    def __init__(self, text: Text, feed: LaneFeed | None) -> None:
        self.text = text
        self.feed = feed
        self.streams: dict[Any, JobStream] = {}
        # Requests with rows: only they stream, so that whatever refuses a request (its
        # grammar, the KV budget) does so before its first delta.
        self.running: set[Any] = set()
        self._done: list[GenResult] = []

    # --- the runner's recorder -----------------------------------------------------------

    def record(self, seqs: Sequence[Seq | None], out: StepOut) -> list[int]:
        """Record one token per live row (None: not a row of this step); returns the rows
        still running. Results of jobs now complete wait for `results`."""
        keep: list[int] = []
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
            top = None
            k = seq.params.logprobs
            if k is not None and out.top_ids is not None and out.top_logprobs is not None:
                top = list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True))
            elif k is not None:
                top = []
            if seq.push(out.tokens[i], out.chosen_logprobs[i], top):
                if seq.job.done:
                    self._done.append(seq.job.result())
            else:
                keep.append(i)
        return keep

    # --- streams (scheduling/lane.py opens them) -----------------------------------------

    def open(self, job: Job, stream: bool) -> None:
        """Stream `job`'s choices as they grow (only requests whose candidates are their
        choices stream: `best_of` > `n` picks the choices at the end)."""
        if stream and JobStream.streams(job):
            self.streams[job.key] = JobStream(self.text, job)

    def flush(self, job: Job) -> None:
        """A job done before any row ran (nothing to generate): its stream, all at once."""
        stream = self.streams.pop(job.key, None)
        if stream is not None and self.feed is not None:
            self.feed.emit(job.key, stream.deltas())

    def admitted(self, key: Any) -> None:
        """The request has rows: its stream shows from now on."""
        if key in self.streams:
            self.running.add(key)

    def close(self, keys: AbstractSet[Any]) -> None:
        """Requests dropped (cancelled, refused): their streams end without a delta."""
        for key in keys & self.streams.keys():
            del self.streams[key]
        self.running -= keys

    # --- after a step --------------------------------------------------------------------

    def emit(self, lane_rows: Callable[[], int]) -> None:
        """One delta per streamed request that gained something this step."""
        feed = self.feed
        if feed is None:
            return
        feed.rows(lane_rows())
        for key, stream in list(self.streams.items()):
            if key not in self.running:
                continue  # no row yet: nothing is shown before its last refusal could come
            deltas = stream.deltas()
            if deltas:
                feed.emit(key, deltas)
            if stream.finished:
                del self.streams[key]
                self.running.discard(key)

    def results(self) -> list[GenResult]:
        out, self._done = self._done, []
        return out
