"""A stack of its own for the embedding service tests: the shared-service stack (own
database and queues, API, sweeper) with a registry holding an encoder, a decoder (both
tiny, random, in sentence-transformers' layout) and the demo generation model, and one
worker serving the two embedding models."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Proc
from tests.shared.conftest import Service, run_service

# A small limit on inputs per batch file, so the limit is testable with a small file.
BATCH_INPUTS = 40


@pytest.fixture(scope="package")
def embed_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from batchwright.engine.embed.tiny import build_decoder, build_encoder

    logging.getLogger("transformers").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("embed_models")
    return {
        "enc": build_encoder(root / "enc", matryoshka=[32, 16]),
        "dec": build_decoder(root / "dec"),
    }


@pytest.fixture(scope="package")
def service(
    bw_home: Path, embed_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    models = {
        "demo": {"path": str(bw_home / "models" / "demo"), "max_rows": 16},
        # Found from its sentence-transformers layout (modules.json)...
        "enc": {"path": str(embed_paths["enc"]), "max_batch_tokens": 512},
        # ... or said in the registry.
        "dec": {"path": str(embed_paths["dec"]), "task": "embed"},
    }
    yield from run_service(
        bw_home,
        tmp_path_factory,
        BATCHWRIGHT_MODELS=json.dumps({"models": models}),
        BATCHWRIGHT_MAX_BATCH_EMBEDDING_INPUTS=str(BATCH_INPUTS),
    )


@pytest.fixture(scope="package")
def embed_worker(service: Service) -> Proc:
    (proc,) = service.workers(["--models", "enc,dec"])
    return proc
