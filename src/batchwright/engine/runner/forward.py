"""The model's forwards as the runner calls them: one packed row under an attention plan
(compiled on CUDA), a padded forward of transformers' own attention, and echo scoring."""

from __future__ import annotations

import time
from typing import Any

import torch

from batchwright.engine.attention.interface import PLAN_KWARG, Step, planned
from batchwright.engine.loading.loader import LoadedModel
from batchwright.engine.lora.run import Lora
from batchwright.engine.platform.compiled import Compiled, compile_on
from batchwright.engine.requests.jobs import PromptScores
from batchwright.engine.requests.observer import Observer
from batchwright.engine.runner.graphs import graphs_on
from batchwright.registry import ModelSpec

# Top-k over the prompt's positions is computed in slices of this many positions so the
# float32 log-softmax of a long prompt never materialises at once.
_SCORE_CHUNK = 256


class Forward:
    """Built once per loaded model. `observers` are told each forward's time (the list is
    the engine's: Engine.observe)."""

    def __init__(self, lm: LoadedModel, spec: ModelSpec, observers: list[Observer]) -> None:
        self.lm = lm
        self.observers = observers
        # A 4-D mask is taken as built: transformers then builds none. Without one it
        # checks the position ids for packed sequences, reading a boolean back from the
        # device every forward (a host sync); under a plan the attention uses no mask.
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=lm.device)
        # The forward under a varlen plan, compiled on CUDA (compiled.py).
        self.compiled: Compiled | None = None
        if compile_on(spec, lm.device, lm.backend):
            self.compiled = Compiled(self._forward, "model's forward", dynamic=True)
        # LoRA adapters share this forward (engine/lora/): its linear layers are wrapped
        # once here; the dense kernel where the forward is compiled or captured.
        self.lora: Lora | None = None
        if spec.max_loras > 0:
            self.lora = Lora(
                lm.model,
                spec.name,
                max_loras=spec.max_loras,
                max_rank=spec.max_lora_rank,
                device=lm.device,
                dtype=lm.dtype,
                dense=self.compiled is not None
                or graphs_on(spec, lm.device, lm.backend)
                or lm.device.type == "cuda",
                max_tokens=max(1, spec.max_rows)
                + max(max(1, spec.max_batch_tokens), lm.context_length),
            )

    def last(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits [rows, vocab] at each row's last position, extending `cache` in place."""
        start = time.perf_counter() if self.observers else 0.0
        kwargs: dict[str, Any] = {self.lm.cache_kwarg: cache, "use_cache": True}
        if self.lm.has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        logits: torch.Tensor = out.logits[:, -1, :]
        if self.observers:
            prompt = int(mask.sum()) if ids.shape[-1] > 1 else 0
            self._tell(time.perf_counter() - start, prompt)
        return logits

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None, plan: Step
    ) -> torch.Tensor:
        """One packed row through the model under `plan` (needs `lm.varlen`); logits
        [len(keep), vocab] at the positions `keep` (None: every position)."""
        start = time.perf_counter() if self.observers else 0.0
        kwargs: dict[str, Any] = {"use_cache": False, "attention_mask": self._no_mask}
        if self.lm.has_logits_to_keep:
            kwargs["logits_to_keep"] = 0 if keep is None else keep
        forward = self.compiled if self.compiled is not None else self._forward
        with planned(plan):
            logits = forward(ids[None], positions[None], plan, kwargs)[0]
        if keep is not None and not self.lm.has_logits_to_keep:
            logits = logits.index_select(0, keep)
        if self.observers:
            # The tokens after the decode rows, less the padding: also the prompts whose
            # attention is not in `bounds` (cached prefixes, batch-invariant steps).
            self._tell(time.perf_counter() - start, ids.shape[0] - plan.rows - plan.pad)
        return logits

    def _tell(self, seconds: float, prompt_tokens: int) -> None:
        for observer in self.observers:
            observer.forward(seconds, prompt_tokens)

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
