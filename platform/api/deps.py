"""Request dependencies: the app's state, a DB session, the calling tenant, the admin check."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from loraplex.engine.async_engine import StreamingEngine
from loraplex.engine.models.spec import ModelSpec
from loraplex.platform.admin_session import SESSION_COOKIE, check_session_request
from loraplex.platform.api.errors import APIError
from loraplex.platform.db import crud
from loraplex.platform.db.models import ApiKey, Tenant
from loraplex.platform.metrics import Metrics
from loraplex.platform.security import constant_time_equals
from loraplex.platform.settings import Settings
from loraplex.platform.store import AdapterCache, AdapterStore

log = logging.getLogger("loraplex.platform")


@dataclass
class AppState:
    settings: Settings
    sessions: sessionmaker
    store: AdapterStore
    cache: AdapterCache
    metrics: Metrics
    admin_key: str
    model_name: str = ""  # the public name of the base model in `model`
    model_dir: Path | None = None  # its folder (the demo is converted there on first use)
    spec: ModelSpec | None = None
    engine: StreamingEngine | None = None  # None until the model is loaded (thread or process)
    accepting: bool = True  # False while shutting down
    inflight: set = field(default_factory=set)
    # Why the engine could not start or stopped, in one line; /healthz and /readyz say it.
    engine_error: str | None = None
    # Called once with that line; `loraplex serve` sets it to stop the server with a non-zero
    # exit so the orchestrator restarts the pod (an app without it just answers 503).
    on_fatal: Callable[[str], None] | None = None

    def engine_failed(self, cause: str) -> None:
        if self.engine_error is not None:
            return
        self.engine_error = cause
        if self.on_fatal is not None:
            self.on_fatal(cause)

    def check_engine(self) -> str | None:
        """Why the engine cannot serve (failed to start, or died since), else None. A death
        seen here is recorded at once, before the watcher's next look."""
        engine = self.engine
        if self.engine_error is None and engine is not None and not engine.stats().alive:
            error = getattr(engine, "error", None)
            reason = " ".join(str(error).split()) if error else "its thread or process is gone"
            log.error("the engine stopped: %s", reason)
            self.engine_failed(f"the engine stopped: {reason}")
        return self.engine_error


def get_state(request: Request) -> AppState:
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


@dataclass
class Caller:
    tenant: Tenant
    key: ApiKey


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
