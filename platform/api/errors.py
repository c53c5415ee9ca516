"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

The `openai` client maps the HTTP status to its exception classes (400 BadRequestError,
401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError,
413/422 as APIStatusError / UnprocessableEntityError, 429 RateLimitError, 5xx InternalServerError).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from loraplex.platform.errors import APIError, error_body

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_DESCRIPTIONS = {
    400: "invalid request: wrong type, unknown field, value out of range",
    401: "missing, unknown, revoked or expired API key",
    403: "the key may not use this route",
    404: "no such model, adapter, tenant or key (for this tenant)",
    409: "already exists",
    413: "body or adapter too large",
    422: "an adapter that cannot be served",
    429: "quota or rate limit reached; see Retry-After",
    503: "the model is loading, the engine stopped, or the adapter store is unreachable",
}


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI entries for the errors a router's routes answer, all in ErrorBody's shape, so
    that the published document says every status a client can see (schemathesis checks it)."""
    return {c: {"model": ErrorBody, "description": _DESCRIPTIONS[c]} for c in codes}


API_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503)


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """Every method some route serves at this path (Starlette's 405 names only the first
    route whose path matched, so GET /x with a PATCH /x beside it said `Allow: GET`)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "__none__"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _is_tag(part: object) -> bool:
    """Parts of a pydantic error location that are not the request's own path: where the value
    came from, and which member of a union was tried ("stop.str" is about "stop")."""
    if isinstance(part, int):
        return False
    text = str(part)
    return (text in ("body", "query", "path", "header") or text in _TYPE_TAGS
            or "[" in text or text.startswith(("function-", "literal")))  # fmt: skip


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(
            error_body(exc.status, exc.message, exc.code, exc.param),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if not _is_tag(p)]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "")
        return JSONResponse(
            error_body(400, msg or "invalid request", "invalid_value", param), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request)
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=headers,
        )
