"""Prompt text to token ids, bounded by the context: a prompt of megabytes is tokenized only
as far as it must be to know it cannot fit (issue 33: a 2 MB prompt stalled every stream
of its worker for 1.9 s while the whole of it was tokenized)."""

from __future__ import annotations

from typing import Any


def tokenize(tokenizer: Any, text: str, context_length: int, **options: Any) -> list[int]:
    """The ids of `text`, cut after context_length + 1 of them: more than the context
    says it does not fit, whatever comes after."""
    ids = tokenizer(text, truncation=True, max_length=context_length + 1, **options).input_ids
    return list(ids)


def counted(ids: list[int], context_length: int) -> str:
    """How many tokens `ids` (cut by `tokenize`) stand for, as an error message says it."""
    return f"more than {context_length}" if len(ids) > context_length else str(len(ids))
