"""The engine the worker calls: `Engine.load(spec)` once, then `engine.run(requests)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch

from batchwright.engine.attention import PLAN_KWARG, Step, planned
from batchwright.engine.chat import build_chat_result, prepare_chat
from batchwright.engine.compiled import Compiled, compile_on
from batchwright.engine.grammar import Grammars
from batchwright.engine.graphs import graphs_on
from batchwright.engine.host_memory import freeze_heap
from batchwright.engine.jobs import Job, PromptScores, bad_request, prepare
from batchwright.engine.loader import LoadedModel, load_model
from batchwright.engine.lora.run import Lora
from batchwright.engine.paged import PagedCache, block_size_for, pool_blocks
from batchwright.engine.result import build_result
from batchwright.engine.scheduler import Scheduler
from batchwright.engine.stop import IncrementalText, StreamText
from batchwright.engine.token_keys import TokenKeys
from batchwright.engine.types import GenRequest, GenResult
from batchwright.protocol.endpoints import CHAT, endpoint_of
from batchwright.registry import ModelSpec

if TYPE_CHECKING:
    from batchwright.engine.online import OnlineFeed

# Top-k over the prompt's positions is computed in slices of this many positions so the
# float32 log-softmax of a long prompt never materialises at once.
_SCORE_CHUNK = 256


class Engine:
    def __init__(self, lm: LoadedModel, spec: ModelSpec) -> None:
        self.lm = lm
        self.spec = spec
        self.model_name = spec.name
        self.system_fingerprint = lm.fingerprint
        self.max_rows = max(1, spec.max_rows)
        self.max_batch_tokens = max(1, spec.max_batch_tokens)
        tok = lm.tokenizer
        self._tok = tok
        self._keys = TokenKeys(tok, self.decode)
        self.attention_backend = lm.backend
        # A 4-D mask is taken as built: transformers then builds none. Without one it
        # checks the position ids for packed sequences, reading a boolean back from the
        # device every forward (a host sync); under a plan the attention uses no mask.
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=lm.device)
        # The forward under a varlen plan, compiled on CUDA (compiled.py).
        self._compiled: Compiled | None = None
        if compile_on(spec, lm.device, self.attention_backend):
            self._compiled = Compiled(self._forward, "model's forward", dynamic=True)
        self.grammars = Grammars(tok, lm.vocab_size, lm.eos_ids)
        # LoRA adapters share this model's forward (engine/lora/): its linear layers are
        # wrapped once here; the dense kernel where the forward is compiled or captured.
        self.lora: Lora | None = None
        if spec.max_loras > 0:
            self.lora = Lora(
                lm.model,
                spec.name,
                max_loras=spec.max_loras,
                max_rank=spec.max_lora_rank,
                device=lm.device,
                dtype=lm.dtype,
                dense=self._compiled is not None
                or graphs_on(spec, lm.device, self.attention_backend)
                or lm.device.type == "cuda",
                max_tokens=self.max_rows + max(self.max_batch_tokens, lm.context_length),
            )

    @classmethod
    def load(cls, spec: ModelSpec) -> Engine:
        engine = cls(load_model(spec), spec)
        # What loading left alive lives as long as the process: out of the collector's
        # full passes, which walked it all (host_memory.py).
        freeze_heap()
        return engine

    # --- text ----------------------------------------------------------------------------

    def text_stream(self) -> IncrementalText | StreamText:
        """A growing text for streamed deltas: the tokenizer's own incremental decoder
        when it has one (a fast tokenizer), else IncrementalText over `decode`."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            try:
                return StreamText(backend)
            except ImportError:  # tokenizers before DecodeStream (0.21)
                pass
        return IncrementalText(self.decode)

    def decode(self, ids: list[int]) -> str:
        return str(
            self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def token_text(self, token: int) -> str:
        """The token as logprobs write it (`bytes:\\xNN` for byte fragments)."""
        return self._keys.key(token)

    def token_piece(self, token: int) -> str:
        """The token decoded on its own (what `text_offset` counts)."""
        return self._keys.text(token)

    # --- requests ------------------------------------------------------------------------

    def prepare(self, greq: GenRequest) -> Job | GenResult:
        if greq.adapter is not None and self.lora is None:
            return bad_request(
                greq.key,
                f"The model '{greq.adapter[:200]}' is an adapter of '{self.model_name}', "
                "whose workers serve no adapters (max_loras 0).",
                "model",
                "model_not_found",
            )
        job = self._prepare(greq)
        if isinstance(job, Job):
            # Compiled off the loop; the intake admits the job once it is ready.
            job.grammar = self.grammars.request(job.req.response_format)
            if job.adapter is not None and self.lora is not None:
                job.lora = self.lora.store.request(job.adapter)  # read off the loop too
        return job

    def _prepare(self, greq: GenRequest) -> Job | GenResult:
        if endpoint_of(greq.body) == CHAT:
            return prepare_chat(
                greq,
                self._tok,
                self.lm.chat_template,
                self.model_name,
                self.decode,
                vocab_size=self.lm.vocab_size,
                context_length=self.lm.context_length,
                eos_ids=self.lm.eos_ids,
            )
        return prepare(
            greq,
            self._tok,
            self.decode,
            vocab_size=self.lm.vocab_size,
            context_length=self.lm.context_length,
            eos_ids=self.lm.eos_ids,
        )

    def result(self, job: Job) -> GenResult:
        model, fingerprint = self.model_name, self.system_fingerprint
        if job.adapter is not None and job.lora is not None:
            model = job.adapter
            fingerprint = job.lora.result().fingerprint(fingerprint)
        if job.chat is not None:
            return build_chat_result(
                job,
                model=model,
                fingerprint=fingerprint,
                decode=self.decode,
                tok=self.token_text,
                piece=self._keys.text,
                raw=self._keys.raw_bytes,
            )
        return build_result(
            job,
            model=model,
            fingerprint=fingerprint,
            decode=self.decode,
            tok=self.token_text,
            piece=self.token_piece,
        )

    def run(
        self,
        requests: Iterable[GenRequest],
        cancelled: Callable[[], AbstractSet[Any]] | None = None,
        online: OnlineFeed | None = None,
    ) -> Iterator[GenResult]:
        """Results as requests complete. `cancelled`, called at most once per step, returns
        request keys to drop at once (running or waiting); no result comes for them.
        `online`: requests admitted ahead of `requests`, streamed (engine/online.py)."""
        return Scheduler(self).run(requests, cancelled, online)

    # --- cache ---------------------------------------------------------------------------

    def new_cache(self) -> PagedCache:
        cfg = self.lm.model.config.get_text_config()
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        # Each layer's KV shape as the model projects it (the loader's probe); the config's
        # fields only where none was taken.
        shapes = self.lm.kv_shapes or [(kv_heads, head_dim, head_dim)] * int(cfg.num_hidden_layers)
        device = self.lm.device
        bs = block_size_for(device, self.spec.kv_block_size)
        token_bytes = sum(h * (dk + dv) for h, dk, dv in shapes) * self.lm.dtype.itemsize
        blocks = pool_blocks(
            kv_tokens=self.spec.kv_tokens,
            max_rows=self.max_rows,
            context_length=self.lm.context_length,
            block_size=bs,
            token_bytes=token_bytes,
            device=device,
        )
        return PagedCache(
            layers=len(shapes),
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.lm.dtype,
            device=device,
            block_size=bs,
            num_blocks=blocks,
            max_rows=self.max_rows,
            context_length=self.lm.context_length,
            shapes=shapes,
        )

    # --- model ---------------------------------------------------------------------------

    def forward_last(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits [rows, vocab] at each row's last position, extending `cache` in place."""
        kwargs: dict[str, Any] = {self.lm.cache_kwarg: cache, "use_cache": True}
        if self.lm.has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def forward_step(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None, plan: Step
    ) -> torch.Tensor:
        """One packed row through the model under `plan` (needs `lm.varlen`); logits
        [len(keep), vocab] at the positions `keep` (None: every position)."""
        kwargs: dict[str, Any] = {"use_cache": False, "attention_mask": self._no_mask}
        if self.lm.has_logits_to_keep:
            kwargs["logits_to_keep"] = 0 if keep is None else keep
        forward = self._compiled if self._compiled is not None else self._forward
        with planned(plan):
            logits = forward(ids[None], positions[None], plan, kwargs)[0]
        if keep is None or self.lm.has_logits_to_keep:
            return logits
        return logits.index_select(0, keep)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, plan: Step, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """The model under `plan` (what compiled.py compiles): logits [1, tokens, vocab]."""
        out = self.lm.model(input_ids=ids, position_ids=positions, **{PLAN_KWARG: plan}, **kwargs)
        logits: torch.Tensor = out.logits
        return logits

    @torch.inference_mode()
    def score_prompt(self, ids: list[int], k: int, adapter: str | None = None) -> PromptScores:
        """Logprob of each prompt token given its prefix (None for the first) and top-k,
        under `adapter` if one is named."""
        x = torch.tensor([ids], device=self.lm.device)
        if adapter is not None and self.lora is not None:
            with self.lora.scoring(adapter):
                logits = self.lm.model(input_ids=x, use_cache=False).logits[0, :-1]
        else:
            logits = self.lm.model(input_ids=x, use_cache=False).logits[0, :-1]
        lps: list[float | None] = [None]
        tops: list[list[tuple[int, float]] | None] = [None]
        target = x[0, 1:]
        for s in range(0, logits.shape[0], _SCORE_CHUNK):
            lp = torch.log_softmax(logits[s : s + _SCORE_CHUNK].float(), dim=-1)
            lps.extend(lp.gather(1, target[s : s + _SCORE_CHUNK, None])[:, 0].tolist())
            if k > 0:
                vals, idx = lp.topk(k, dim=-1)
                for row_ids, row_vals in zip(idx.tolist(), vals.tolist(), strict=True):
                    tops.append(list(zip(row_ids, row_vals, strict=True)))
            else:
                tops.extend([] for _ in range(lp.shape[0]))
        return lps, tops
