"""Chat lines: `messages` rendered by the model's chat template into a completion prompt.

A chat line runs as a completion of its rendered prompt (token ids, no echo, no best_of),
so it shares rows, seeds and prefix reuse with completion lines; only the way in (the
template, here) and the way out (message, chat logprobs: serving/chat.py) differ.
"""

from __future__ import annotations

from typing import Any

from batchwright.engine.requests.jobs import bad_request
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.protocol.chat import ChatCompletionRequest, check_chat_body
from batchwright.protocol.completions import CompletionRequest
from batchwright.protocol.endpoints import CHAT
from batchwright.serving.validated import request_of


class TemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def render(
    tokenizer: Any, template: str | None, req: ChatCompletionRequest, model: str
) -> tuple[str, list[int]]:
    """The prompt of `req.messages` by the model's template, ending where the assistant's
    reply starts: its text and its token ids. `developer` messages render as `system`
    (OpenAI's newer name for it, unknown to most templates).

    The ids are not the text tokenized with special tokens parsed: a message holding
    "<|im_end|><|im_start|>system" (or the EOS text) would become those control tokens
    and forge a turn. transformers' `sanitize_control_tokens` encodes the control tokens
    that come from messages as plain text, and only those the template writes as tokens."""
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(
            f"The model {model!r} has no chat template, so it cannot take "
            "/v1/chat/completions requests; send /v1/completions requests, or name a "
            "template file in the model's registry entry (chat_template).",
            "model",
        )
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text,
        }
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            sanitize_control_tokens=True,
            return_dict=False,
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates
        raise TemplateError(
            f"The model's chat template cannot render these messages: {str(exc)[:300]}",
            "messages",
        ) from None
    return str(text), [int(t) for t in ids]


def as_completion(req: ChatCompletionRequest, prompt: list[int], max_tokens: int) -> Any:
    """The completion the engine runs for a chat request: its rendered prompt as token ids,
    its sampling parameters (already validated, so not validated again: top_logprobs may
    be up to 20 where completions take 5)."""
    return CompletionRequest.model_construct(
        model=req.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        n=req.n,
        best_of=None,
        stop=req.stop,
        echo=False,
        logprobs=req.top_k,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        seed=req.seed,
        user=req.user,
        suffix=None,
        stream=None,
        stream_options=None,
        response_format=req.response_format,
    )


def prepare_chat(
    greq: GenRequest,
    tokenizer: Any,
    template: str | None,
    model: str,
    *,
    vocab_size: int,
    context_length: int,
) -> EngineRequest | GenResult:
    """Parse a chat line, render and tokenize its prompt; a GenResult(400) when the model
    must reject it."""
    req, err = check_chat_body(greq.body)
    if err is not None or req is None:
        return GenResult(key=greq.key, status_code=400, error=err)
    try:
        # The template writes the special tokens (BOS and the like) itself.
        text, ids = render(tokenizer, template, req, model)
    except TemplateError as exc:
        code = "no_chat_template" if exc.param == "model" else "invalid_messages"
        return bad_request(greq.key, str(exc), exc.param, code)
    limit = req.max_new_tokens
    room = context_length - len(ids)
    if room <= 0 or (limit is not None and limit > room):
        param = "messages" if limit is None or room <= 0 else _limit_param(req)
        asked = f"; {limit} for the completion ('{_limit_param(req)}')" if limit else ""
        return bad_request(
            greq.key,
            f"This model's maximum context length is {context_length} tokens, however your "
            f"messages take {len(ids)} tokens in the model's chat template{asked}. Please "
            "reduce the length of the messages or completion.",
            param,
            "context_length_exceeded",
        )
    return request_of(
        greq,
        as_completion(req, ids, room if limit is None else limit),
        [ids],
        [text],
        vocab_size=vocab_size,
        endpoint=CHAT,
    )


def _limit_param(req: ChatCompletionRequest) -> str:
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
