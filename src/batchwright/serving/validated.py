"""A parsed body and its tokenized prompts as the engine takes them (EngineRequest)."""

from __future__ import annotations

from batchwright.engine.requests.jobs import bad_request
from batchwright.engine.requests.request import EngineRequest, Sampling
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.protocol.completions import CompletionRequest


def sampling_of(req: CompletionRequest, logit_bias: dict[int, float]) -> Sampling:
    return Sampling(
        max_tokens=req.max_tokens,
        n=req.n,
        candidates=req.candidates,
        temperature=req.temperature,
        top_p=req.top_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=logit_bias,
        logprobs=req.logprobs,
        echo=req.echo,
        stop_list=req.stop_list,
        seed=req.seed,
    )


def request_of(
    line: GenRequest,
    req: CompletionRequest,
    prompts: list[list[int]],
    echo_texts: list[str],
    *,
    vocab_size: int,
    endpoint: str,
) -> EngineRequest | GenResult:
    """The request of a line whose prompts are tokenized (a chat line's: rendered), or a
    400 when its logit_bias names a token outside the vocabulary."""
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        if int(k) >= vocab_size:
            return bad_request(
                line.key,
                f"Invalid 'logit_bias': token id {k} is outside the model's vocabulary "
                f"(ids 0 to {vocab_size - 1}).",
                "logit_bias",
                None,
            )
        bias[int(k)] = v
    return EngineRequest(
        line.key,
        prompts,
        echo_texts,
        sampling_of(req, bias),
        endpoint,
        group=line.group,
        stream=line.stream,
        response_format=req.response_format,
        adapter=line.adapter,
    )
