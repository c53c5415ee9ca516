"""The FastAPI application: wiring only; routes live in platform/api/routes/."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from loraplex.engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineProcess,
    LLMEngine,
    StreamingEngine,
    keep_freed_memory,
    resolve_model,
    server_options,
)
from loraplex.platform import tracing
from loraplex.platform.adapter_service import collect_periodically, store_for
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.routes import (
    adapters,
    admin,
    admin_ui,
    batches,
    files,
    health,
    inference,
    lora_admin,
    portal,
)
from loraplex.platform.batch_runner import BatchRunner
from loraplex.platform.db.session import ensure_at_head, make_engine, make_sessionmaker
from loraplex.platform.ledger import watch_database
from loraplex.platform.metrics import Metrics
from loraplex.platform.openai.bill_on_send import BillOnSend
from loraplex.platform.replicas import Heartbeat
from loraplex.platform.security import new_admin_key
from loraplex.platform.settings import Settings
from loraplex.platform.state import AppState
from loraplex.platform.store import AdapterCache

log = logging.getLogger("loraplex.platform")


def engine_config(settings: Settings, model_dir: str) -> EngineConfig:
    """The engine options the settings carry (each derived from its one definition in
    engine/options.py), for the model in `model_dir`."""
    options = {o.name: getattr(settings, o.setting) for o in server_options()}
    if options["num_threads"] is None:  # leave a core to the HTTP loop
        options["num_threads"] = max(1, len(os.sched_getaffinity(0)) - 1)
    return EngineConfig(model=model_dir, **options)


def resolve_model_dir(settings: Settings) -> str:
    return resolve_model(settings.model, settings.data_dir)


def load_engine(
    state: AppState, model_dir: str, on_ready: Callable[[], None] | None = None
) -> None:
    """Load the engine (or start the vLLM data plane) and make it `state.engine`, which turns
    /readyz ready. `on_ready` runs just before that (`serve`'s quickstart lines: printed when
    they answer, and before a ready /readyz, which scripts wait for before reading them)."""
    if state.settings.data_plane == "vllm":  # a vLLM fleet over HTTP (platform/dataplane/)
        from loraplex.platform.dataplane import make_vllm

        plane = make_vllm(state, model_dir)
        plane.start()  # until a vLLM answers, /readyz says "loading model"
        state.spec = plane.spec
        _ready(state, plane, on_ready)
        log.info("vLLM data plane ready: %s", ", ".join(e.url for e in plane.endpoints))
        return
    config = engine_config(state.settings, model_dir)
    if state.settings.engine_process:
        queued = state.settings.engine_queued_requests
        proc = EngineProcess(config, progress=True, max_queued_requests=queued)
        state.spec = proc.spec
        state.metrics.set_memory(proc.memory)
        serving: StreamingEngine = proc
    else:
        keep_freed_memory()  # the server's process hosts the engine (engine/memory/host_malloc.py)
        engine = LLMEngine(config, progress=True)
        state.spec = engine.model.spec
        state.metrics.set_memory(engine.memory)
        serving = AsyncLLMEngine(engine)
    if state.settings.disagg_prefill_urls and state.settings.disagg_decode_urls:
        from loraplex.platform.disagg import disaggregated  # prefill / decode workers

        serving = disaggregated(serving, state.settings)
    _ready(state, serving, on_ready)
    log.info("model %s ready", state.model_name)


def _ready(state: AppState, engine: StreamingEngine, on_ready: Callable[[], None] | None) -> None:
    if on_ready is not None:
        try:
            on_ready()
        except Exception:  # noqa: BLE001 - a closed stdout must not stop the server
            log.warning("the ready announcement failed", exc_info=True)
    state.engine = engine


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if type(e) is RuntimeError and text else f"{type(e).__name__}: {text}"


def load_engine_or_fail(
    state: AppState, model_dir: str, on_ready: Callable[[], None] | None = None
) -> None:
    """The loader thread: a model that cannot load must not leave a server answering 503
    "loading" for ever. The cause goes to the log in one line (the traceback at debug level)
    and to `state.engine_failed`, which stops `loraplex serve` with a non-zero exit."""
    try:
        load_engine(state, model_dir, on_ready)
    except BaseException as e:  # noqa: BLE001 - any load failure ends the server
        cause = _one_line(e)
        if not cause.startswith("the engine process could not start"):
            cause = f"the engine could not start: {cause}"
        log.error(cause)
        log.debug("engine start failure", exc_info=True)
        state.engine_failed(cause)


async def watch_engine(state: AppState, interval: float = 0.2) -> None:
    """Turn an engine that died after start (process killed, thread crashed) into a fatal
    error at once: /readyz goes 503 and `serve` exits non-zero once in-flight requests end."""
    while state.check_engine() is None:
        await asyncio.sleep(interval)


def create_app(
    settings: Settings, *, load_model: bool = True, on_ready: Callable[[], None] | None = None
) -> FastAPI:
    """An app over `settings`. The model loads in the background; /readyz says when
    (`on_ready` runs just before it does: load_engine)."""
    db = make_engine(settings.database_url)
    ensure_at_head(db)  # refuses to start on an old schema, saying what to run
    store = store_for(settings)
    store.check()
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else new_admin_key()
    state = AppState(
        settings=settings,
        sessions=make_sessionmaker(db),
        store=store,
        cache=AdapterCache(store, settings.adapter_cache_dir, max_bytes=8 * 1024**3),
        metrics=Metrics(adapter_names=settings.metrics_adapter_names),
        admin_key=admin_key,
    )
    model_dir = resolve_model_dir(settings)
    state.model_dir = Path(model_dir)
    state.model_name = state.model_dir.name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(watch_engine(state))
        # Readiness follows the database; the usage journal is written once it answers.
        database_watch = asyncio.create_task(watch_database(state))
        collector = None
        if settings.store_gc_interval_s > 0:
            collector = asyncio.create_task(
                collect_periodically(
                    state,
                    interval_s=settings.store_gc_interval_s,
                    grace_s=settings.store_gc_grace_s,
                )
            )
        heartbeat = None
        if settings.replica_heartbeat_s > 0:  # this replica's engine state, for every overview
            heartbeat = Heartbeat(state, settings.replica_heartbeat_s)
            beating = asyncio.create_task(heartbeat.run())
        runner = BatchRunner(state)  # Batch API jobs, on the capacity interactive work leaves
        batch_loop = asyncio.create_task(runner.run()) if settings.batch_max_active else None
        if load_model:
            threading.Thread(
                target=load_engine_or_fail, args=(state, model_dir, on_ready), daemon=True
            ).start()
        yield
        watcher.cancel()
        database_watch.cancel()
        if collector is not None:
            collector.cancel()
        if batch_loop is not None:
            batch_loop.cancel()
            await runner.stop()  # in-flight lines aborted, leases given back
        # Graceful shutdown: refuse new work, let in-flight requests finish for a while.
        state.accepting = False
        deadline = asyncio.get_running_loop().time() + settings.shutdown_grace_s
        while state.inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if heartbeat is not None:  # beats through the drain, gone with the engine
            beating.cancel()
            await asyncio.to_thread(heartbeat.stop)
        if state.engine is not None:
            state.engine.shutdown()
        state.cache.close()
        state.ledger.close()
        db.dispose()
        if provider is not None:
            provider.shutdown()  # sends the spans still batched

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    app.state.lp = state
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(inference.router)
    app.include_router(adapters.router)
    app.include_router(admin.router)
    app.include_router(lora_admin.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    admin_ui.mount(app)
    portal.mount(app)
    provider = None
    if settings.otlp_traces_endpoint:  # the SDK is imported only here
        provider = tracing.make_provider(settings.otlp_traces_endpoint)
        app.add_middleware(tracing.TracingMiddleware, provider=provider)
    # Outermost: it must see the connection's own `send` (platform/openai/bill_on_send.py).
    app.add_middleware(BillOnSend)
    return app
