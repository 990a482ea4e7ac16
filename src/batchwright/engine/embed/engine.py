"""The embedding engine: prefill only, inputs packed by length, pooled on the device.

`EmbedEngine.load(spec)` once, then `engine.run(jobs, cancelled, feed)`: jobs (token ids
and what pooling needs, prepared by `job`) in, `Embedded` (vectors and the tokens read)
out, each as soon as its last input is done. The wire object is built outside (the
worker's embedding runner, protocol/embeddings.py). Each forward: the inputs queue.py
picks, packed (packing.py), one forward with no cache (attention.py), pooling, Normalize
and Matryoshka truncation on the device (pooling.py), one copy of the vectors back.

Run loop, as the generation engine's: `cancelled()` once a forward drops requests; online
jobs (`feed.take()`) go before batch inputs; a source with `ready()` is read only as far
as it has lines ready while work waits, and waited on when there is none (it may hand
WAKE to end that wait); the read-ahead is bounded by tokens (`_WINDOW` forwards' worth).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from batchwright.engine.embed.attention import packed
from batchwright.engine.embed.model import EmbedModel, load_embed_model
from batchwright.engine.embed.packing import Input, Pack, pack
from batchwright.engine.embed.pooling import finish, pool
from batchwright.engine.embed.queue import InputQueue
from batchwright.engine.platform.host_memory import MMAP_THRESHOLD, freeze_heap
from batchwright.registry import ModelSpec

# Batch tokens read ahead of the forward, in forwards' worth: the wider, the closer in
# length the inputs a forward packs together (fewer attention calls on CPU).
_WINDOW = 4


@dataclass(eq=False)
class EmbedJob:
    """One request: its inputs' token ids, or the error that refused it."""

    key: Any
    group: Any = None
    online: bool = False
    inputs: list[Input] = field(default_factory=list)
    dims: int | None = None  # Matryoshka size asked (`dimensions`)
    error: dict[str, Any] | None = None  # {message, type, param, code}: a 400
    meta: Any = None  # the caller's (how to render the result)
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    left: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(x.ids) for x in self.inputs)


@dataclass
class Embedded:
    job: EmbedJob
    vectors: list[torch.Tensor]  # float32 on the CPU, one per input, in input order
    tokens: int  # what the model read (prompts and special tokens included)


class Feed(Protocol):
    """Online requests (the worker's relay pump, adapted): engine/requests/feed.py's
    LaneFeed."""

    def take(self) -> list[EmbedJob]: ...

    def started(self, key: Any, prompt_tokens: int) -> None: ...

    def rows(self, online: int) -> None: ...


# A source may yield this to end the engine's wait for input (an online request came).
WAKE = EmbedJob(key=None)


def _error(index: int | None, message: str, code: str | None = None) -> dict[str, Any]:
    where = "input" if index is None else f"input[{index}]"
    return {
        "message": f"Invalid '{where}': {message}",
        "type": "invalid_request_error",
        "param": "input",
        "code": code,
    }


def forward_tokens(lm: EmbedModel, asked: int) -> int:
    """Tokens one forward takes. On CPU, no more than keeps its widest activation (the
    MLP's, [tokens, intermediate]) under glibc's mmap threshold: a larger one is a fresh
    mmap every layer, paid in page faults and zeroing (a MiniLM-sized encoder ran 7 %
    slower per token at 8,192 tokens a forward than at 2,048-5,400, the same inputs
    alternating in one process). Never below one input of the longest the model takes."""
    if lm.device.type != "cpu":
        return asked
    config = lm.model.config.get_text_config()
    width = max(lm.dim, int(getattr(config, "intermediate_size", 0) or 4 * lm.dim))
    cap = MMAP_THRESHOLD // (width * lm.dtype.itemsize)
    return max(1, min(asked, max(cap, lm.context_length)))


def _owner(item: Input) -> EmbedJob:
    job: EmbedJob = item.owner  # type: ignore[assignment]
    return job


class EmbedEngine:
    def __init__(self, lm: EmbedModel, spec: ModelSpec) -> None:
        self.lm = lm
        self.spec = spec
        self.model_name = spec.name
        self.system_fingerprint = lm.fingerprint
        self.max_rows = max(1, spec.max_rows)  # online requests in flight (the worker's pump)
        self.max_batch_tokens = max(1, spec.max_batch_tokens)
        self.forward_tokens = forward_tokens(lm, self.max_batch_tokens)
        # Called with (seconds, tokens) after each forward (worker metrics).
        self.on_forward: Callable[[float, int], None] | None = None

    @classmethod
    def load(cls, spec: ModelSpec) -> EmbedEngine:
        engine = cls(load_embed_model(spec), spec)
        freeze_heap()
        return engine

    # --- requests --------------------------------------------------------------------------

    def job(
        self,
        key: Any,
        inputs: list[str] | list[list[int]],
        *,
        dims: int | None = None,
        group: Any = None,
        online: bool = False,
        max_tokens: int | None = None,
    ) -> EmbedJob:
        """A request's inputs tokenized and checked against the model: text gets the
        model's prompt and special tokens; token ids go in as given."""
        job = EmbedJob(key=key, group=group, online=online, dims=dims)
        lm = self.lm
        if dims is not None and dims != lm.dim and dims not in lm.config.matryoshka:
            sizes = ", ".join(str(d) for d in sorted({*lm.config.matryoshka, lm.dim}))
            job.error = {
                "message": (
                    f"Invalid 'dimensions': {dims}; this model gives {lm.dim} dimensions"
                    + (f" and can be cut to {sizes}" if lm.config.matryoshka else "")
                    + (
                        "."
                        if lm.config.matryoshka
                        else " and declares no Matryoshka dimensions to cut them to."
                    )
                ),
                "type": "invalid_request_error",
                "param": "dimensions",
                "code": None,
            }
            return job
        if dims == lm.dim:
            job.dims = None
        single = len(inputs) == 1
        prompt_tokens = 0
        if inputs and isinstance(inputs[0], str):
            ids_list, prompt_tokens = self._tokenize(inputs)
        else:
            ids_list = inputs  # type: ignore[assignment]
        total = 0
        for i, ids in enumerate(ids_list):
            where = None if single else i
            if len(ids) > lm.context_length:
                job.error = _error(
                    where,
                    f"{len(ids)} tokens, over the model's maximum context length of "
                    f"{lm.context_length} tokens. Shorten it or split it.",
                    "context_length_exceeded",
                )
                return job
            if isinstance(inputs[0], list):
                bad = next((t for t in ids if t >= lm.vocab_size), None)
                if bad is not None:
                    job.error = _error(
                        where,
                        f"token id {bad} is outside the model's vocabulary "
                        f"(0-{lm.vocab_size - 1}).",
                    )
                    return job
            total += len(ids)
            job.inputs.append(Input(job, i, list(ids), prompt_tokens))
        if max_tokens is not None and total > max_tokens:
            job.error = _error(
                None,
                f"the inputs hold {total} tokens together, over the maximum of {max_tokens} "
                "per request. Split them over several requests.",
                "max_tokens_per_request",
            )
            job.inputs = []
        job.vectors = [None] * len(job.inputs)
        job.left = len(job.inputs)
        return job

    def _tokenize(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Token ids as sentence-transformers' Transformer module makes them (lower-cased
        where its config says, the default prompt in front; since version 6 it no longer
        strips whitespace), and the tokens of the prompt that pooling may leave out."""
        lm = self.lm
        cfg = lm.config
        if cfg.do_lower_case:
            texts = [t.lower() for t in texts]
        prompt_tokens = 0
        if cfg.prompt:
            texts = [cfg.prompt + t for t in texts]
            # As sentence-transformers counts it: the prompt tokenized, less a trailing
            # special token.
            alone: list[int] = lm.tokenizer(cfg.prompt)["input_ids"]
            special = set(lm.tokenizer.all_special_ids)
            prompt_tokens = len(alone) - (1 if alone and alone[-1] in special else 0)
        ids: list[list[int]] = lm.tokenizer(texts)["input_ids"]
        return ids, prompt_tokens

    # --- the loop --------------------------------------------------------------------------

    def run(
        self,
        jobs: Iterable[EmbedJob],
        cancelled: Callable[[], AbstractSet[Any]] | None = None,
        feed: Feed | None = None,
    ) -> Iterator[Embedded | EmbedJob]:
        """Results as jobs complete: `Embedded`, or the job itself when it was refused
        (its `error`). Jobs whose keys `cancelled()` returns leave at once, with no
        result."""
        it = iter(jobs)
        ready: Callable[[], int] | None = getattr(jobs, "ready", None)
        queue = InputQueue(self.forward_tokens)
        live: dict[Any, EmbedJob] = {}
        exhausted = False
        while True:
            if cancelled is not None:
                gone = cancelled()
                if gone:
                    owners = {live.pop(k) for k in gone if k in live}
                    queue.drop(owners)
            if feed is not None:
                for job in feed.take():
                    job.online = True
                    if job.error is None:
                        feed.started(job.key, job.tokens)
                    yield from self._admit(job, queue, live)
            if not exhausted:
                room = _WINDOW * self.max_batch_tokens - queue.tokens
                if not queue:
                    exhausted = yield from self._read(it, queue, live, wait=True)
                elif room > 0 and ready is not None:
                    exhausted = yield from self._read(it, queue, live, limit=ready())
                elif room > 0:
                    exhausted = yield from self._read(it, queue, live, room=room)
            if not queue:
                if exhausted and not live:
                    return
                continue
            inputs = queue.next_pack(lambda x: _owner(x).group)
            if feed is not None:
                feed.rows(len({id(x.owner) for x in inputs if _owner(x).online}))
            yield from self._forward(inputs, live)

    def _admit(
        self, job: EmbedJob, queue: InputQueue, live: dict[Any, EmbedJob]
    ) -> Iterator[EmbedJob]:
        if job.error is not None or not job.inputs:
            yield job
            return
        live[job.key] = job
        for item in job.inputs:
            queue.add(item, job.online)

    def _read(
        self,
        it: Iterator[EmbedJob],
        queue: InputQueue,
        live: dict[Any, EmbedJob],
        *,
        wait: bool = False,
        limit: int | None = None,
        room: int | None = None,
    ) -> Generator[EmbedJob, None, bool]:
        """Jobs from the source: with `wait` (nothing to do) a forward's worth, waiting for
        each (`max_rows` requests or `max_batch_tokens` tokens, as the generation engine
        waits for a batch's worth: a forward of the first line alone, then of the next,
        would run a line at a time while a claim's lines arrive); else `limit` ready ones,
        or until `room` tokens are read. Returns True when the source ended."""
        count = 0
        while True:
            if limit is not None and count >= limit:
                return False
            if room is not None and count and queue.tokens >= room:
                return False
            if wait and queue and (count >= self.max_rows or queue.tokens >= self.forward_tokens):
                return False
            job = next(it, None)
            if job is None:
                return True
            if job is WAKE:
                return False
            count += 1
            yield from self._admit(job, queue, live)

    @torch.inference_mode()
    def _forward(self, inputs: list[Input], live: dict[Any, EmbedJob]) -> Iterator[Embedded]:
        import time

        start = time.perf_counter()
        lm = self.lm
        p = pack(
            inputs,
            lm.device,
            position_offset=lm.position_offset,
            # FlashAttention's varlen kernel takes half precision only.
            varlen=lm.device.type == "cuda" and lm.dtype in (torch.float16, torch.bfloat16),
            skip_prompt=not lm.config.include_prompt,
        )
        hidden = self.forward(p)
        vectors = pool(hidden, p, lm.pooling)
        dims = [_owner(x).dims or 0 for x in p.inputs]
        cut = torch.tensor(dims, device=lm.device) if any(dims) else None
        out = finish(vectors, lm.config.normalize, cut).cpu()
        if self.on_forward is not None:
            self.on_forward(time.perf_counter() - start, p.tokens)
        finished: list[EmbedJob] = []
        for row, item in zip(out, p.inputs, strict=True):
            job: EmbedJob = item.owner  # type: ignore[assignment]
            if job.key not in live:
                continue  # cancelled meanwhile
            job.vectors[item.index] = row[: job.dims] if job.dims else row
            job.left -= 1
            if job.left == 0:
                finished.append(job)
        finished.sort(key=lambda j: not j.online)
        for job in finished:
            del live[job.key]
            yield Embedded(job, [v for v in job.vectors if v is not None], job.tokens)

    def forward(self, p: Pack) -> torch.Tensor:
        """Last hidden states of the pack's tokens, [tokens, hidden], in row order."""
        lm = self.lm
        if not lm.packed:
            return self._forward_padded(p)
        kwargs: dict[str, Any] = {"input_ids": p.ids, "position_ids": p.positions}
        if lm.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(p.ids)
        with packed(p.plan):
            out = lm.model(**kwargs, use_cache=False) if lm.causal else lm.model(**kwargs)
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def _forward_padded(self, p: Pack) -> torch.Tensor:
        """The model's own attention on a padded batch of the pack's inputs (they are of
        close lengths): the padding is computed and dropped."""
        lm = self.lm
        n, width = len(p.inputs), max(len(x.ids) for x in p.inputs)
        ids = torch.full((n, width), lm.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, item in enumerate(p.inputs):
            ids[i, : len(item.ids)] = torch.tensor(item.ids)
            mask[i, : len(item.ids)] = 1
        ids, mask = ids.to(lm.device), mask.to(lm.device)
        positions = (torch.arange(width, device=lm.device) + lm.position_offset).expand(n, -1)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
        }
        if lm.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        out = lm.model(**kwargs)
        hidden: torch.Tensor = out.last_hidden_state[mask.bool()]
        return hidden
