"""Per-project quotas on enqueued work, checked when a batch is validated.

Enqueued lines: lines of the project's batches in progress. Enqueued tokens (OpenAI's
enqueued-token limit): prompt tokens plus max_tokens for every completion a line asks for.
Prompt tokens are counted with the model's tokenizer (tokenizer.json, torch-free) where the
validating worker can read it, else estimated at 4 bytes of UTF-8 per token. A chat line
counts its messages' text plus a few tokens per message for the template, and a line
without a completion limit counts the model's context length.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchwright.db.models import Batch, Project
from batchwright.protocol.chat import ChatCompletionRequest
from batchwright.protocol.embeddings import EmbeddingRequest
from batchwright.protocol.endpoints import LineRequest
from batchwright.registry import Registry


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(file))


# Template tokens per chat message (role markers, separators), as OpenAI counts them.
_PER_MESSAGE = 4
_DEFAULT_CONTEXT = 2048


@lru_cache(maxsize=8)
def _context_length(path: str) -> int:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        return int(config.get("max_position_embeddings") or _DEFAULT_CONTEXT)
    except (OSError, ValueError, TypeError):
        return _DEFAULT_CONTEXT


class TokenCounter:
    """Counts a line's enqueued tokens for one model."""

    def __init__(self, registry: Registry, model: str | None) -> None:
        spec = registry.serving(model) if model else None  # an adapter: its base's tokenizer
        self.tokenizer = _tokenizer(str(spec.path)) if spec is not None else None
        self.context = (spec.context_length if spec else None) or (
            _context_length(str(spec.path)) if spec else _DEFAULT_CONTEXT
        )

    def prompt_tokens(self, prompt: str | list[int]) -> int:
        if not isinstance(prompt, str):
            return len(prompt)
        if self.tokenizer is not None:
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            return len(ids)
        return -(-len(prompt.encode()) // 4)

    def line(self, request: LineRequest) -> int:
        if isinstance(request, EmbeddingRequest):  # its inputs' tokens, nothing generated
            return sum(self.prompt_tokens(x) for x in request.inputs)
        if isinstance(request, ChatCompletionRequest):
            text = sum(self.prompt_tokens(m.text) + _PER_MESSAGE for m in request.messages)
            limit = request.max_new_tokens
            return text + request.n * (limit if limit is not None else self.context)
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = [p for p in prompt if not isinstance(p, int)]
        per_prompt: int = max(request.n, request.best_of or 1) * request.max_tokens
        return sum(self.prompt_tokens(p) for p in prompts) + len(prompts) * per_prompt


def over_limit(session: Session, batch: Batch, lines: int, tokens: int) -> str | None:
    """Why `batch` would take its project past a quota, or None. Locks the project row so
    two batches validated at once cannot both slip under the limit."""
    project = session.scalar(
        select(Project).where(Project.id == batch.project_id).with_for_update()
    )
    if project is None:
        return None
    max_lines, max_tokens = project.max_enqueued_lines, project.max_enqueued_tokens
    if max_lines is None and max_tokens is None:
        return None
    held = session.execute(
        select(
            func.coalesce(func.sum(Batch.total), 0),
            func.coalesce(func.sum(Batch.enqueued_tokens), 0),
        ).where(
            Batch.project_id == project.id,
            Batch.status == "in_progress",
            Batch.id != batch.id,
        )
    ).one()
    held_lines, held_tokens = int(held[0] or 0), int(held[1] or 0)
    if max_lines is not None and held_lines + lines > max_lines:
        return (
            f"Enqueued line limit reached for project {project.name!r}: limit "
            f"{max_lines} lines, {held_lines} already enqueued, this batch adds {lines}. "
            "Try again once your other batches have completed."
        )
    if max_tokens is not None and held_tokens + tokens > max_tokens:
        return (
            f"Enqueued token limit reached for project {project.name!r}: limit "
            f"{max_tokens} tokens (prompt plus max_tokens), {held_tokens} already enqueued, "
            f"this batch adds {tokens}. Try again once your other batches have completed."
        )
    return None
