"""Engine fixtures: a demo-style model built once per session and loaded the real way."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchwright.engine.engine import Engine
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.registry import ModelSpec
from batchwright.serving.lines import serve


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo", seed=0)


@pytest.fixture(scope="session")
def make_engine(demo_path: Path) -> Callable[..., Engine]:
    def make(**spec: Any) -> Engine:
        spec.setdefault("max_rows", 8)
        spec.setdefault("max_batch_tokens", 256)
        # bench/gpu_check.sh runs these tests on a device (BATCHWRIGHT_TEST_DEVICE=cuda,
        # BATCHWRIGHT_TEST_DTYPE=bfloat16, BATCHWRIGHT_TEST_CUDA_GRAPHS and _COMPILE=0/1);
        # default: CPU.
        spec.setdefault("device", os.environ.get("BATCHWRIGHT_TEST_DEVICE", "cpu"))
        spec.setdefault("dtype", os.environ.get("BATCHWRIGHT_TEST_DTYPE", "auto"))
        spec.setdefault("cuda_graphs", os.environ.get("BATCHWRIGHT_TEST_CUDA_GRAPHS") == "1")
        # BATCHWRIGHT_TEST_COMPILE=1/0: torch.compile on or off (unset: the device's default).
        compiled = os.environ.get("BATCHWRIGHT_TEST_COMPILE")
        if compiled in ("0", "1"):
            spec.setdefault("torch_compile", compiled == "1")
        return Engine.load(
            ModelSpec(name=spec.pop("name", "test"), path=spec.pop("path", demo_path), **spec)
        )

    return make


@pytest.fixture(scope="session")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


class Runner:
    """Runs bodies through an engine and returns their GenResults in input order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def many(
        self, bodies: Iterable[dict[str, Any]], engine: Engine | None = None
    ) -> list[GenResult]:
        reqs = [GenRequest(i, {"model": "test", **b}) for i, b in enumerate(bodies)]
        results = {r.key: r for r in serve(engine or self.engine, reqs)}
        assert sorted(results) == list(range(len(reqs)))
        return [results[i] for i in range(len(reqs))]

    def one(self, body: dict[str, Any], engine: Engine | None = None) -> GenResult:
        return self.many([body], engine)[0]

    def ok(self, body: dict[str, Any], engine: Engine | None = None) -> dict[str, Any]:
        r = self.one(body, engine)
        assert r.status_code == 200, r.error
        assert r.completion is not None
        return r.completion


@pytest.fixture(scope="session")
def run(engine: Engine) -> Runner:
    return Runner(engine)


class Direct:
    """Independent reference: full forward passes of the same model, no cache, no padding."""

    def __init__(self, engine: Engine) -> None:
        self.model = engine.lm.model
        self.tok = engine.lm.tokenizer
        self.eos = engine.lm.eos_ids

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text).input_ids)

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log_softmax of the logits at every position [len(ids), vocab]."""
        logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def greedy(
        self,
        ids: list[int],
        steps: int,
        *,
        presence: float = 0.0,
        frequency: float = 0.0,
        bias: dict[int, float] | None = None,
        stop_at_eos: bool = True,
    ) -> list[int]:
        out: list[int] = []
        for _ in range(steps):
            logits = self.model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1]
            logits = logits.float().clone()
            for t in set(out):
                logits[t] -= out.count(t) * frequency + presence
            for t, b in (bias or {}).items():
                logits[t] += b
            nxt = int(logits.argmax())
            out.append(nxt)
            if stop_at_eos and nxt in self.eos:
                break
        return out


@pytest.fixture(scope="session")
def direct(engine: Engine) -> Direct:
    return Direct(engine)
