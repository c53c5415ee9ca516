"""Request dependencies: the app's state, a DB session, the calling tenant, the admin check."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from loraplex.platform.admin_session import SESSION_COOKIE, check_session_request
from loraplex.platform.db import crud
from loraplex.platform.errors import APIError
from loraplex.platform.security import constant_time_equals
from loraplex.platform.state import AppState, Caller

log = logging.getLogger("loraplex.platform")


async def get_state(request: Request) -> AppState:
    # async: FastAPI runs a plain `def` dependency on a worker thread, a thread hop per
    # request for an attribute read (benchmarks/serving_overhead.py).
    return request.app.state.lp


StateDep = Annotated[AppState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
        )
    return token.strip()


def current_caller(request: Request, state: StateDep) -> Caller:
    token = _bearer(request)
    # A session of its own, closed at once: a `SessionDep` would stay open (holding a pooled
    # connection) until a streamed response ends, and long streams would exhaust the pool.
    with state.sessions() as session:
        found = crud.authenticate(session, token)
        if found is None:
            raise APIError(401, "invalid, revoked or expired API key", "invalid_api_key")
        tenant, key = found
        session.expunge_all()  # plain objects from here on
    return Caller(tenant=tenant, key=key)


CallerDep = Annotated[Caller, Depends(current_caller)]


def require_admin(request: Request, state: StateDep) -> None:
    """The admin key as a Bearer token (CLI, automation), or the dashboard's session cookie
    (with its CSRF header on state-changing requests; see `admin_session`)."""
    if "authorization" not in request.headers and SESSION_COOKIE in request.cookies:
        check_session_request(request, state.admin_key)
        return
    token = _bearer(request)
    if not constant_time_equals(token, state.admin_key):
        raise APIError(403, "admin routes need the admin key", "forbidden")


AdminDep = Depends(require_admin)
