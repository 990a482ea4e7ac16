"""A line's prefix key: what claims group a batch's lines by (validation records it).

The engine reuses the keys and values of a shared token prefix (engine/kv/prefix.py), best
when the lines that share it run together on one worker. Validation cannot tokenize (it
runs without the model), so the key is a digest of the prompt's start: its first
`PREFIX_CHARS` characters, or first `PREFIX_IDS` token ids for a token prompt, of the first
prompt of the line. Lines that agree there share a key, and a claim hands out a batch's
lines ordered by key and then by line number. Grouping is only an order: whatever the key,
the engine matches exact tokens, and the output file keeps the input order.

A chat line's key is the same digest of its messages' start (role and text of each, in
order): its template renders them in that order, so a shared system prompt shares a key.
"""

from __future__ import annotations

import hashlib

import orjson

# About 64 tokens of English: long enough that a shared instruction or few-shot header
# decides the key, short enough that lines sharing only a modest prefix still group.
PREFIX_CHARS = 256
PREFIX_IDS = 64


def _messages_text(messages: list[object]) -> str | None:
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role')}\x00{content}\x00")
        if sum(len(p) for p in parts) >= PREFIX_CHARS:
            break
    return "".join(parts)


def prefix_key(prompt: object) -> str | None:
    """16 hex digits, or None for a prompt of no known shape (it fails validation).
    `prompt`: a completion's prompt or a chat line's messages."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = _messages_text(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        # surrogatepass: JSON may carry lone surrogates; a key must never raise.
        head = prompt[:PREFIX_CHARS].encode("utf-8", "surrogatepass")
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:PREFIX_IDS]):
        head = orjson.dumps(prompt[:PREFIX_IDS])
    else:
        return None
    return hashlib.blake2b(head, digest_size=8).hexdigest()
