"""The endpoints a batch (or an online request) may target, and each one's body check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from batchwright.protocol.chat import ChatCompletionRequest, check_chat_body
from batchwright.protocol.completions import CompletionRequest, check_completion_body
from batchwright.protocol.embeddings import EmbeddingRequest, check_embedding_body

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (COMPLETIONS, CHAT, EMBEDDINGS)
# What each kind of model serves (registry.ModelSpec.task).
GENERATE_ENDPOINTS = (COMPLETIONS, CHAT)
EMBED_ENDPOINTS = (EMBEDDINGS,)

LineRequest = CompletionRequest | ChatCompletionRequest | EmbeddingRequest


def check_body(
    endpoint: str, body: object, max_sequences: int | None = None, *, online: bool = False
) -> tuple[LineRequest | None, dict[str, Any] | None]:
    """A body checked as `endpoint` takes it: (request, None) or (None, error). `online`:
    a POST to the endpoint itself (streaming allowed) rather than a batch line. A schema
    is checked against the metaschema here, where bodies come in (and not again where the
    engine reads them)."""
    if endpoint == CHAT:
        return check_chat_body(body, max_sequences, online=online, check_schema=True)
    if endpoint == EMBEDDINGS:
        return check_embedding_body(body)
    return check_completion_body(body, max_sequences, online=online, check_schema=True)


def endpoint_of(body: dict[str, Any]) -> str:
    """Which endpoint a validated body was written for: chat bodies carry `messages`,
    completion bodies `prompt` (each endpoint refuses the others'), so the engine needs
    no second field to tell them apart; embedding bodies carry `input`."""
    if "input" in body:
        return EMBEDDINGS
    return CHAT if "messages" in body else COMPLETIONS


def file_endpoint(path: Path) -> str:
    """The endpoint a batch file's lines target, read from its first line's `url` (a file
    holds one endpoint; lines that differ fail its validation with `url_mismatch`).
    Completions when the first line names none of ours: validation then says why."""
    with path.open("rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                url = orjson.loads(raw.removeprefix(b"\xef\xbb\xbf")).get("url")
            except (orjson.JSONDecodeError, AttributeError):
                return COMPLETIONS
            return url if url in ENDPOINTS else COMPLETIONS
    return COMPLETIONS


def task_error(endpoint: str, model: str, task: str) -> str | None:
    """Why a model of `task` ("generate" | "embed") cannot serve `endpoint`, or None."""
    if task == "embed" and endpoint not in EMBED_ENDPOINTS:
        return (
            f"The model '{model[:200]}' is an embedding model: it serves {EMBEDDINGS}, "
            f"not {endpoint}."
        )
    if task != "embed" and endpoint in EMBED_ENDPOINTS:
        return (
            f"The model '{model[:200]}' is a generation model: it serves {COMPLETIONS} and "
            f"{CHAT}, not {EMBEDDINGS}. Use an embedding model."
        )
    return None
