"""Every error leaves in OpenAI's envelope; a client mistake is never a 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from batchwright.api.guards import printable
from batchwright.api.responses import JSONBody
from batchwright.auth.service import authenticate
from batchwright.db.session import get_sessionmaker
from batchwright.errors import APIError, InvalidRequest, Unauthorized, Unavailable

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "file_too_large"}


def _render(exc: APIError) -> JSONBody:
    return JSONBody(exc.body(), status_code=exc.status_code, headers=exc.headers() or None)


def _param(loc: tuple[int | str, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


async def on_api_error(_: Request, exc: Exception) -> JSONBody:
    assert isinstance(exc, APIError)
    return _render(exc)


def _refused_key(request: Request) -> Unauthorized | None:
    """The 401 a request without a valid key gets: FastAPI parses the body before the
    key dependency runs, and a stranger must learn nothing about a body it may not send."""
    if not request.url.path.startswith("/v1/"):
        return None
    try:
        with get_sessionmaker()() as session:
            authenticate(session, request.headers.get("authorization"))
    except Unauthorized as exc:
        return exc
    except Exception:  # the database is down: the 400 still tells the truth
        return None
    return None


async def on_validation_error(request: Request, exc: Exception) -> JSONBody:
    assert isinstance(exc, RequestValidationError)
    refused = await run_in_threadpool(_refused_key, request)
    if refused is not None:
        return _render(refused)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid request"))
    kind = str(first.get("type", ""))
    code: str | None = _code(kind)
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "string_unicode":  # a lone surrogate in a key, which pydantic cannot name
        where = f"'{param}'" if param else "the request body"
        message = f"A string in {where} is not valid Unicode: it holds a lone UTF-16 surrogate."
    elif kind == "json_invalid":
        # The location is a character offset, not a parameter: OpenAI answers param null.
        message = f"We could not parse the JSON body of your request: {msg}."
        param = None
    else:
        message = f"Invalid value for '{param}': {msg}" if param else msg
    return _render(InvalidRequest(message, param=param, code=code))


# pydantic error types -> the codes OpenAI's API uses for the same mistakes.
_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": None,
    "greater_than": "integer_below_min_value",
    "greater_than_equal": "integer_below_min_value",
    "less_than": "integer_above_max_value",
    "less_than_equal": "integer_above_max_value",
}


def _code(kind: str) -> str | None:
    if kind in _CODES:
        return _CODES[kind]
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return "invalid_type"
    return "invalid_value"


async def on_http_error(_: Request, exc: Exception) -> JSONBody:
    assert isinstance(exc, HTTPException)
    err = APIError(str(exc.detail), code=_HTTP_TYPES.get(exc.status_code))
    err.status_code = exc.status_code
    err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONBody(err.body(), status_code=exc.status_code, headers=exc.headers)


async def on_db_error(_: Request, exc: Exception) -> JSONBody:
    log.warning("database unavailable: %s", exc)
    return _render(Unavailable("The database is unavailable; retry the request.", retry_after=1))


async def on_client_gone(request: Request, _: Exception) -> Response:
    # Not a server error: the transaction rolled back and nothing of the body was kept.
    log.warning(
        "%s %s: the client left before sending its whole body",
        printable(request.method),
        printable(request.url.path),
    )
    return Response(status_code=400)  # nobody reads it


async def on_unexpected(_: Request, exc: Exception) -> JSONBody:
    log.exception("unhandled error", exc_info=exc)
    return _render(APIError("Internal server error."))


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(OperationalError, on_db_error)
    app.add_exception_handler(DBAPIError, on_db_error)
    app.add_exception_handler(Exception, on_unexpected)
