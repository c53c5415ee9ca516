"""Liveness, readiness and Prometheus metrics; vLLM's probe routes (`/health`, `/ping`,
`/version`) for clients written against vLLM (load generators, routers, SageMaker)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from loraplex.platform.api.deps import StateDep

router = APIRouter(tags=["operations"])


class Health(BaseModel):
    status: str  # "ok" / "ready", or why not: "loading model", "engine stopped"...
    model: str | None = None
    error: str | None = None  # the engine's failure, in one line


_PROBE = {
    "response_model": Health,
    "responses": {503: {"model": Health, "description": "not ready"}},
}


@router.get("/healthz", **_PROBE)
async def healthz(state: StateDep):
    """The process is alive and its engine has not failed (loading still counts as alive).
    The probes run on the event loop, not in the worker threads, which a database that does
    not answer may all hold."""
    if (error := state.check_engine()) is not None:
        return JSONResponse({"status": "engine stopped", "error": error}, status_code=503)
    return {"status": "ok"}


@router.get("/readyz", **_PROBE)
async def readyz(state: StateDep):
    """Ready to serve: model loaded, engine alive and answering, database reachable, not
    shutting down."""
    if (error := state.check_engine()) is not None:
        return JSONResponse({"status": "engine stopped", "error": error}, status_code=503)
    if state.engine is None or not state.accepting:
        reason = "shutting down" if not state.accepting else "loading model"
        return JSONResponse({"status": reason}, status_code=503)
    unavailable = getattr(state.engine, "unavailable", None)  # a remote data plane's own say
    if unavailable is not None and (why := unavailable()) is not None:
        return JSONResponse({"status": "data plane unavailable", "error": why}, status_code=503)
    if not state.database.up:
        body = {"status": "database unreachable", "error": state.database.cause}
        return JSONResponse(body, status_code=503)
    if (stalled := state.engine_stalled_s()) is not None:
        body = {"status": "engine unresponsive",
                "error": f"the engine has not answered for {stalled:.0f} s"}  # fmt: skip
        return JSONResponse(body, status_code=503)
    return {"status": "ready", "model": state.model_name}


def _serving(state) -> bool:
    return state.check_engine() is None and state.engine is not None and state.accepting


# vLLM answers /health with 200 and an empty body, 503 once its engine is dead. Its HTTP
# server only listens once the model is loaded; ours answers while loading and while draining,
# so both are 503 here too: a client that waits for 200 then sends requests that are served.
_VLLM_PROBE = {
    "response_class": Response,
    "responses": {200: {"description": "serving (empty body)"}, 503: {"description": "not"}},
}


@router.get("/health", **_VLLM_PROBE)
def health(state: StateDep):
    """vLLM's health check: 200 (empty body) when requests can be served, else 503."""
    return Response(status_code=200 if _serving(state) else 503)


@router.get("/ping", **_VLLM_PROBE)
def ping(state: StateDep):
    """vLLM's /ping (SageMaker's health contract): as /health."""
    return health(state)


@router.post("/ping", **_VLLM_PROBE)
def ping_post(state: StateDep):
    """vLLM's /ping by POST, as SageMaker sends it: as /health."""
    return health(state)


@router.get("/version")
def version():
    """The server's version, in vLLM's shape: {"version": ...}."""
    try:
        return {"version": package_version("loraplex")}
    except PackageNotFoundError:  # run from a checkout without an install
        return {"version": "unknown"}


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
)
def metrics(state: StateDep):
    """Ours (`loraplex_*`) and the model-server protocol a LoRA-aware router scrapes
    (`vllm:*`); see platform/metrics.py."""
    m = state.metrics
    with m.lock:
        m.model_loaded.set(1 if state.engine is not None else 0)
        if state.engine is not None:
            m.refresh(state.engine.stats())
        text = generate_latest(m.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
