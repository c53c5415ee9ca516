"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

The `openai` client maps the HTTP status to its exception classes (400 BadRequestError,
401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError,
413/422 as APIStatusError / UnprocessableEntityError, 429 RateLimitError, 5xx InternalServerError).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


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
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
