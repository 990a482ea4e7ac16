"""`batchwright complete PROMPT [--stream]`: one online completion from a running service."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from batchwright.client.common import ApiKey, BaseUrl, ClientError, Json, connect, err, handled


@handled
def complete(
    prompt: Annotated[str, typer.Argument(help="The prompt ('-' reads it from stdin).")],
    model: Annotated[
        str | None, typer.Option(help="Default: the service's only model, or 'demo'.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=0)] = 16,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0)] = 1.0,
    n: Annotated[int, typer.Option(min=1, help="Completions of the prompt.")] = 1,
    stop: Annotated[list[str] | None, typer.Option(help="A stop sequence (up to 4).")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stream: Annotated[bool, typer.Option(help="Print the text as it is generated.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Complete PROMPT on a running service (POST /v1/completions); the text goes to
    stdout, the token usage to stderr."""
    client = connect(base_url, api_key)
    text = sys.stdin.read() if prompt == "-" else prompt
    params: dict[str, Any] = {
        "model": model or _default_model(client),
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "n": n,
    }
    if stop:
        params["stop"] = stop
    if seed is not None:
        params["seed"] = seed
    if not stream:
        completion = client.completions.create(**params)
        if as_json:
            sys.stdout.write(completion.model_dump_json(indent=2) + "\n")
            return
        for choice in completion.choices:
            if n > 1:
                sys.stdout.write(f"--- {choice.index} ({choice.finish_reason})\n")
            sys.stdout.write(choice.text + "\n")
        _usage(completion.usage)
        return
    if as_json:
        raise ClientError("--json prints a whole Completion: leave out --stream")
    _stream(client, params, n)


def _stream(client: Any, params: dict[str, Any], n: int) -> None:
    """One choice is printed as it comes; several are printed each when it finishes."""
    texts: dict[int, list[str]] = {}
    usage = None
    for chunk in client.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if n == 1:
                sys.stdout.write(choice.text)
                sys.stdout.flush()
                continue
            texts.setdefault(choice.index, []).append(choice.text)
            if choice.finish_reason is not None:
                sys.stdout.write(f"--- {choice.index} ({choice.finish_reason})\n")
                sys.stdout.write("".join(texts.pop(choice.index)) + "\n")
    if n == 1:
        sys.stdout.write("\n")
    _usage(usage)


def _default_model(client: Any) -> str:
    names = [m.id for m in client.models.list()]
    return names[0] if len(names) == 1 else "demo"


def _usage(usage: Any) -> None:
    if usage is not None:
        err.print(
            f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens",
            style="dim",
        )
