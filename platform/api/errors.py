"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

The `openai` client maps the HTTP status to its exception classes (400 BadRequestError,
401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError,
413/422 as APIStatusError / UnprocessableEntityError, 429 RateLimitError, 5xx InternalServerError).
"""

from __future__ import annotations

import email.message
import logging
import re
import tempfile
from pathlib import Path

from fastapi import FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from loraplex.platform.api.deps import require_admin
from loraplex.platform.db.health import is_unavailable
from loraplex.platform.errors import APIError, error_body
from loraplex.platform.openai.bodies import TextOnlyJSONBodies

log = logging.getLogger("loraplex.platform")

DATABASE_RETRY_AFTER_S = 5  # the database probe's pace makes readiness follow within this
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# FastAPI's message when a JSON body is not UTF-8 (json.loads raises UnicodeDecodeError).
_BODY_PARSE_ERROR = "There was an error parsing the body"

_DESCRIPTIONS = {
    400: "invalid request: wrong type, unknown field, value out of range",
    401: "missing, unknown, revoked or expired API key",
    403: "the key may not use this route",
    404: "no such model, adapter, tenant or key (for this tenant)",
    409: "already exists",
    413: "body or adapter too large",
    415: "a body that is not JSON sent to a JSON route",
    422: "an adapter that cannot be served",
    429: "quota or rate limit reached; see Retry-After",
    503: "the model is loading, the engine stopped or is busy, or the database or the adapter "
    "store is unreachable; see Retry-After",
}


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI entries for the errors a router's routes answer, all in ErrorBody's shape, so
    that the published document says every status a client can see (schemathesis checks it)."""
    return {c: {"model": ErrorBody, "description": _DESCRIPTIONS[c]} for c in codes}


API_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 415, 422, 429, 503)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """Every method some route serves at this path (Starlette's 405 names only the first
    route whose path matched, so GET /x with a PATCH /x beside it said `Allow: GET`).
    Each method is tried through `matches`, the routes' public interface: an included router
    is one route with no `methods` of its own, whose full match says its routes serve it."""
    methods = [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in app.router.routes
        )
    ]
    return ", ".join(methods)


def _is_tag(part: object) -> bool:
    """Parts of a pydantic error location that are not the request's own path: where the value
    came from, and which member of a union was tried ("stop.str" is about "stop")."""
    if isinstance(part, int):
        return False
    text = str(part)
    return (text in ("body", "query", "path", "header") or text in _TYPE_TAGS
            or "[" in text or text.startswith(("function-", "literal")))  # fmt: skip


def _wants_json(request: Request) -> bool:
    """The matched route takes a JSON body (not a form) and the request says it sent another
    media type: FastAPI then validates the raw bytes and answers "Input should be a valid
    dictionary", where HTTP has 415."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    body = getattr(dependant, "body_params", None)
    if not body or any(isinstance(f.field_info, params.Form) for f in body):
        return False
    header = request.headers.get("content-type")
    if not header:
        return False  # FastAPI reads a body without a content type as JSON
    message = email.message.Message()
    message["content-type"] = header
    kind, sub = message.get_content_maintype(), message.get_content_subtype()
    return not (kind == "application" and (sub == "json" or sub.endswith("+json")))


def _server_paths(request: Request) -> list[str]:
    """The folders of this server, which a tenant-facing message must never name."""
    state = getattr(request.app.state, "lp", None)
    folders: list[Path] = [Path(tempfile.gettempdir())]
    if state is not None:
        s = state.settings
        folders += [s.data_dir, s.adapter_cache_dir, *s.adapter_import_roots]
        folders += [p for p in (s.local_store_dir, state.model_dir) if p is not None]
    texts = {str(f) for f in folders} | {str(f.resolve()) for f in folders}
    return sorted((t for t in texts if t not in ("", "/")), key=len, reverse=True)


def _admin_route(request: Request) -> bool:
    route = request.scope.get("route")
    stack = [getattr(route, "dependant", None)]
    while stack:
        dependant = stack.pop()
        if dependant is not None:
            if dependant.call is require_admin:
                return True
            stack += dependant.dependencies
    return False


def public_message(request: Request, message: str) -> str:
    """`message` without this server's folders, nor what follows them up to a space or quote
    (file names, digests). Messages are written to name none; this is the net under those that
    carry a library's text (an OSError's, the engine's). Host names are left alone: a short one
    ("vm", "gpu") would also match a tenant's own words."""
    if _admin_route(request):
        return message  # the operator named these paths (lora_path) or owns them
    cleaned = message
    for folder in _server_paths(request):
        cleaned = re.sub(re.escape(folder) + r"[^\s'\"]*", "<server path>", cleaned)
    if cleaned != message:
        log.info("error message for %s %s: %s", request.method, request.url.path, message)
    return cleaned


def _json_error(request: Request, status: int, message: str, code=None, param=None, headers=None):
    body = error_body(status, public_message(request, message), code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(TextOnlyJSONBodies)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _json_error(request, exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if _wants_json(request):
            got = request.headers.get("content-type", "").split(";")[0].strip()
            msg = f"this route takes a JSON body: send Content-Type: application/json, not {got}"
            return _json_error(request, 415, msg, "unsupported_media_type")
        if first.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}"
            return _json_error(request, 400, msg, "invalid_json")
        loc = [str(p) for p in first.get("loc", []) if not _is_tag(p)]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "")
        return _json_error(request, 400, msg or "invalid request", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request)
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_ERROR:
            msg = "the body is not valid JSON: it must be UTF-8 text"
            return _json_error(request, 400, msg, "invalid_json", headers=headers)
        return _json_error(request, exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(DataError)
    @app.exception_handler(OverflowError)
    async def _unstorable(request: Request, exc: DataError | OverflowError):
        # The database refused a value the request carried where no check of ours stood before
        # it: PostgreSQL takes no NUL in text, nor an id past its integer range (DataError);
        # SQLite's driver refuses an int past 64 bits (OverflowError).
        cause = exc.orig if isinstance(exc, DataError) else exc
        log.info("%s %s: a value the database cannot take: %s", request.method,
                 request.url.path, " ".join(str(cause).split()))  # fmt: skip
        msg = "a value in this request cannot be used: text with a NUL character, or a number "
        msg += "out of range"
        return _json_error(request, 400, msg, "invalid_value")

    @app.exception_handler(DBAPIError)
    @app.exception_handler(DisconnectionError)
    @app.exception_handler(PoolTimeout)
    async def _database(request: Request, exc: Exception):
        if not is_unavailable(exc):
            raise exc  # a statement of ours the database refused: a bug, answered as one
        # An outage: retryable, logged once per outage (platform/db/health.py), no traceback.
        state = getattr(request.app.state, "lp", None)
        if state is not None:
            state.database.failed(exc)
        msg = "the database is unavailable; retry shortly"
        headers = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
        return _json_error(request, 503, msg, "database_unavailable", headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug of ours: the traceback goes to the log (Starlette re-raises it after this
        # answer), the client gets the shape every other error has and nothing of the cause.
        msg = "the server failed on this request; the error was logged"
        return JSONResponse(error_body(500, msg, "internal_error"), status_code=500)
