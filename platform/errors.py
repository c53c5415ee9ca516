"""The error a request gets, in OpenAI's shape: the service layer raises `APIError` (status,
message, code, param); the HTTP layer (api/errors.py) and the SSE streams render it with
`error_body` as `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

# The code of an error raised without one (Starlette's own: no route, wrong method, a form the
# multipart parser refuses): clients branch on `code`, so it is never null.
CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_value",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "unavailable",
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
            "code": code or CODES.get(status, "error"),
        }
    }
