"""Multipart uploads held to a byte limit before and while they arrive.

A declared Content-Length past the limit is refused at once; a chunked upload declares none,
and the form parser spools whatever it reads to disk, so the body is also counted as it
arrives and refused the moment it passes the limit (plus the form's own framing).
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import Message, Receive

from loraplex.platform.api.errors import APIError

FORM_SLACK = 64 * 1024  # the multipart framing and the small fields around the files


def _capped(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit + FORM_SLACK:
            raise APIError(413, f"upload exceeds the limit of {limit} bytes", "too_large")
        return message

    return capped


def limited(request: Request, limit: int) -> Request:
    """`request` whose body may not pass `limit` bytes of files (413 `too_large`)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + FORM_SLACK:
        raise APIError(
            413, f"upload of {declared} bytes exceeds the limit of {limit} bytes", "too_large"
        )
    return Request(request.scope, _capped(request.receive, limit))
