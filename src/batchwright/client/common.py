"""What every client command shares: the connection options, one-line errors, output."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    import httpx
    import openai

BaseUrl = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        envvar="OPENAI_BASE_URL",
        help="The service, e.g. http://127.0.0.1:8000/v1.",
        show_default=False,
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key", envvar="OPENAI_API_KEY", help="An API key (sk-bw-…).", show_default=False
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]

# No markup: what is printed comes from the service and from people (file names, messages,
# metadata) and may hold brackets that Rich would take for tags and drop.
out = Console(highlight=False, markup=False)
# Errors are one line whatever the terminal width.
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)

P = ParamSpec("P")
R = TypeVar("R")


class ClientError(Exception):
    """A mistake the command reports in one line (exit 1)."""


def connect(base_url: str | None, api_key: str | None) -> openai.OpenAI:
    import openai  # the SDK only for commands that talk to a service (`keys list` does not)

    url = (base_url or "http://127.0.0.1:8000/v1").rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"  # people paste the server's address; the API lives under /v1
    if not api_key:
        raise ClientError("no API key: set OPENAI_API_KEY or pass --api-key")
    # The SDK would wait out a 429's Retry-After (up to a minute) in silence and retry: a
    # person at a terminal gets the 429 at once instead, with the wait the service names.
    http = openai.DefaultHttpxClient(event_hooks={"response": [_no_retry_on_429]})
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=1, timeout=60, http_client=http)


def _no_retry_on_429(response: httpx.Response) -> None:
    if response.status_code == 429:
        response.headers["x-should-retry"] = "false"  # the SDK obeys this header


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc.message)


def _where(exc: openai.APIConnectionError) -> str:
    try:
        url = exc.request.url
    except RuntimeError:  # no request attached
        return "the given address"
    return f"{url.scheme}://{url.netloc.decode()}"


def _why(exc: openai.APIConnectionError) -> str:
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timed out"
    cause = str(exc.__cause__ or exc).lower()
    return "connection refused" if "refused" in cause else cause[:120] or "no answer"


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Service and usage failures as one clear line on stderr, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import openai

        try:
            return fn(*args, **kwargs)
        except openai.APIConnectionError as exc:
            err.print(f"error: cannot reach the batchwright service at {_where(exc)} "
                      f"({_why(exc)}); is it running? (--base-url or OPENAI_BASE_URL)")  # fmt: skip
        except openai.AuthenticationError as exc:
            err.print(f"error: the service refused the API key (401): {_message(exc)}")
        except openai.NotFoundError as exc:
            err.print(f"error: not found (404): {_message(exc)}")
        except openai.RateLimitError as exc:
            err.print(f"error: over the project's rate limit (429): {_message(exc)}")
        except openai.APIStatusError as exc:
            err.print(f"error: the service answered {exc.status_code}: {_message(exc)}")
        except (ClientError, OSError) as exc:
            err.print(f"error: {exc}")
        raise typer.Exit(1)

    return wrapper


def when(ts: int | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def print_json(data: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> None:
    if isinstance(data, BaseModel):
        sys.stdout.write(data.model_dump_json(indent=2) + "\n")
    elif isinstance(data, dict):
        import json

        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        import json

        sys.stdout.write(json.dumps([d.model_dump(mode="json") for d in data], indent=2) + "\n")


def table(
    columns: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None
) -> None:
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
    t = Table(title=title)
    for i, name in enumerate(columns):
        # Ids are for copying: never cut or folded, the other columns give way.
        widest = max((len(row[i]) for row in cells), default=0)
        if i == 0:
            t.add_column(name, no_wrap=True, min_width=max(widest, len(name)))
        else:
            t.add_column(name, overflow="fold")
    for row in cells:
        t.add_row(*row)
    out.print(t)


def fields(pairs: Iterable[tuple[str, object]], title: str | None = None) -> None:
    t = Table(show_header=False, title=title)
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    for name, value in pairs:
        t.add_row(name, "-" if value is None else str(value))
    out.print(t)


def atomic_write(path: os.PathLike[str] | str, chunks: Iterable[bytes]) -> None:
    """Write under a temporary name and rename when complete."""
    final = os.fspath(path)
    tmp = os.path.join(os.path.dirname(final) or ".", f".{os.path.basename(final)}.partial")
    try:
        with open(tmp, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
