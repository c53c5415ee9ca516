"""What the service layer works with: the app's state (settings, database, store, engine,
metrics) and the authenticated caller. The HTTP layer (api/deps.py) hands these to routes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from loraplex.engine import ModelSpec, StreamingEngine
from loraplex.platform.db.health import DatabaseHealth
from loraplex.platform.db.models import ApiKey, Tenant
from loraplex.platform.journal import Journal
from loraplex.platform.ledger import Ledger
from loraplex.platform.metrics import Metrics
from loraplex.platform.settings import Settings
from loraplex.platform.store import AdapterCache, AdapterStore

log = logging.getLogger("loraplex.platform")
JOURNAL_FILE = "usage-journal.db"


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
    streams: dict = field(default_factory=dict)  # request id -> Job of each running stream
    # Why the engine could not start or stopped, in one line; /healthz and /readyz say it.
    engine_error: str | None = None
    # Called once with that line; `loraplex serve` sets it to stop the server with a non-zero
    # exit so the orchestrator restarts the pod (an app without it just answers 503).
    on_fatal: Callable[[str], None] | None = None
    # Whether the database answers (a probe and every request keep it); /readyz says it.
    database: DatabaseHealth = field(default_factory=DatabaseHealth)
    # Usage records and quota corrections: to the database, or to the data dir's journal
    # while it cannot take them (platform/ledger.py).
    ledger: Ledger = field(init=False)

    def __post_init__(self) -> None:
        journal = Journal(self.settings.data_dir / JOURNAL_FILE)
        self.ledger = Ledger(self.sessions, journal, self.database)

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

    def engine_stalled_s(self) -> float | None:
        """How long the engine has held requests without a sign of life, once that is past
        `engine_unresponsive_s`; else None."""
        unresponsive = getattr(self.engine, "unresponsive_s", None)  # a data plane may not say
        stalled = unresponsive() if unresponsive is not None else 0.0
        return stalled if stalled > self.settings.engine_unresponsive_s else None


@dataclass
class Caller:
    tenant: Tenant
    key: ApiKey
