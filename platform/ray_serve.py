"""Ray Serve mode: the FastAPI app as a Ray Serve deployment multiplexed over adapters.

Each replica runs the whole app of `create_app` (API keys, quotas, usage ledger, routes,
one engine) as its `@serve.ingress`, so Ray mode has no request path of its own. What Ray
adds is routing: a request carrying the header `serve_multiplexed_model_id: <adapter>` (the
name the tenant puts in `model`) goes to a replica that already holds that adapter. A
replica "holds" an adapter once its `@serve.multiplexed` loader has run for the name:

    request ──▶ Ray proxy ──(model id → replicas holding it)──▶ replica
                                                               │ _AdapterAffinity (ASGI):
                                                               │   caller = API-key check
                                                               │   load_adapter(model id)
                                                               ▼   (registry → store → disk)
                                                             the FastAPI app, unchanged

The loader runs only for an authenticated caller and resolves the name among that caller's
adapters (the same lookup the route does), so nobody can make a replica fetch another
tenant's adapter. The route then serves the request as on any replica, whether or not the
loader ran: the header steers, it never decides what is served.

Entry points: `loraplex serve --ray [--replicas N]`, or `serve run
loraplex.platform.ray_serve:build_app num_replicas=2` with `LORAPLEX_*` in the environment.
Ray is the optional `ray` extra and is imported only here, inside functions.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from loraplex.platform.api.deps import current_caller
from loraplex.platform.errors import APIError, error_body
from loraplex.platform.main import create_app, load_engine
from loraplex.platform.security import new_admin_key
from loraplex.platform.serving import InferenceService
from loraplex.platform.settings import Settings
from loraplex.platform.state import Caller

APP_NAME, DEPLOYMENT_NAME = "loraplex", "LoraplexReplica"
REPLICA_HEADER = "x-loraplex-replica"  # the replica actor that answered
LOAD_HEADER = "x-loraplex-adapter-load"  # "cold": this request ran the loader; "warm": held
MODEL_ID_HEADER = "serve_multiplexed_model_id"
RAY_EXTRA = "Ray Serve mode needs the `ray` extra: pip install 'loraplex[ray]'"
# Read by Ray's HTTP proxy when it starts: set it in the environment of the cluster.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "loraplex.platform.ray_serve.proxy_middlewares"

log = logging.getLogger("loraplex.platform")


class RayMissing(RuntimeError):
    """Ray is not installed (the `ray` extra)."""


def _serve():
    try:
        from ray import serve
    except ImportError:
        raise RayMissing(RAY_EXTRA) from None
    return serve


@dataclass
class _Load:
    """What the affinity middleware hands the loader for one request."""

    caller: Caller
    cold: bool = False


_current_load: contextvars.ContextVar[_Load | None] = contextvars.ContextVar(
    "loraplex_adapter_load", default=None
)


@dataclass(frozen=True)
class HeldAdapter:
    """A name this replica holds: fetched to its disk cache for the first caller."""

    name: str
    digest_id: int


class _AdapterAffinity:
    """Pure ASGI (streams pass through untouched): run the multiplexed loader for the
    request's model id, then the app; tag the answer with the replica and the load."""

    def __init__(self, app, *, replica: LoraplexReplica):
        self.app = app
        self.replica = replica

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        load = await self.replica.hold_for(Request(scope))

        async def tagged_send(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), self.replica.replica_name.encode()))
                if load is not None:
                    headers.append((LOAD_HEADER.encode(), b"cold" if load.cold else b"warm"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged_send)


class LoraplexReplica:
    """One replica: the app over its own engine, loaded before the replica takes traffic."""

    def __init__(self, settings: dict[str, Any], max_adapters: int | None = None):
        serve = _serve()
        self.settings = Settings(**settings)
        self.replica_name = serve.get_replica_context().replica_id.to_full_id_str()
        held = max_adapters or self.settings.max_cpu_loras or 4 * self.settings.max_loras

        async def load_adapter(model_id: str) -> HeldAdapter:
            return await self._load_adapter(model_id)

        # Held names are what Ray routes by: as many as the engine keeps in host memory.
        self.load_adapter = serve.multiplexed(max_num_models_per_replica=held)(load_adapter)
        self.api = create_app(self.settings, load_model=False)
        self.api.add_middleware(_AdapterAffinity, replica=self)

    async def __serve_build_asgi_app__(self):
        # Loaded here, not in the app's background thread: Ray sends a replica traffic as
        # soon as it is constructed, and a half-loaded one would answer 503 "loading".
        state = self.api.state.lp
        await asyncio.to_thread(load_engine, state, str(state.model_dir))
        return self.api

    def check_health(self) -> None:
        """Ray restarts a replica whose engine failed (the server would exit non-zero)."""
        error = self.api.state.lp.check_engine()
        if error is not None:
            raise RuntimeError(error)

    async def hold_for(self, request: Request) -> _Load | None:
        """Run the loader for an authenticated request that names a model id; None when the
        request names none or the caller cannot be identified (the route answers that)."""
        model_id = _serve().get_multiplexed_model_id()
        state = self.api.state.lp
        if not model_id or model_id == state.model_name:
            return None
        try:
            caller = await asyncio.to_thread(current_caller, request, state)
        except APIError:
            return None
        load = _Load(caller)
        token = _current_load.set(load)
        try:
            await self.load_adapter(model_id)
        except APIError:
            pass  # not this tenant's adapter, or the store is down: the route answers it
        finally:
            _current_load.reset(token)
        return load

    async def _load_adapter(self, model_id: str) -> HeldAdapter:
        load = _current_load.get()
        assert load is not None, "the loader runs only from the affinity middleware"
        service = InferenceService(self.api.state.lp)
        lora, _ = await asyncio.to_thread(service.resolve_model, load.caller, model_id)
        load.cold = True
        log.info("replica %s now holds adapter %r", self.replica_name, model_id)
        return HeldAdapter(model_id, lora.lora_int_id)


class _ReplicaLost:
    """In Ray's proxy: a request whose replica died before answering gets our 503 in
    OpenAI's shape (with Retry-After) instead of the proxy's bare 500 "Internal Server Error".
    The app itself never answers 500 in plain text, so only the proxy's own is replaced; a
    stream already under way when its replica dies just ends (no `[DONE]`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = replaced = False

        async def guarded_send(message):
            nonlocal started, replaced
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                plain = not headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] == 500 and plain:
                    replaced = True
                    return
                started = True
            elif replaced:
                return  # the bare 500's body
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception:
            if started:
                raise
            log.warning("a replica failed before answering", exc_info=True)
        if not started:
            await _send_replica_lost(send)


async def _send_replica_lost(send) -> None:
    body = json.dumps(
        error_body(
            503,
            "the replica serving this request stopped before it answered; retry the request",
            "replica_unavailable",
        )
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """For `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (see PROXY_CALLBACK_ENV)."""
    from starlette.middleware import Middleware

    return [Middleware(_ReplicaLost)]


def replica_settings(settings: Settings) -> dict[str, Any]:
    """Settings as plain keyword arguments for the replicas, secrets included, with one admin
    key for all of them (each replica would otherwise generate its own in dev mode)."""
    values = settings.model_dump()
    for name, value in values.items():
        if hasattr(value, "get_secret_value"):
            values[name] = value.get_secret_value()
    if values["admin_key"] is None:
        values["admin_key"] = new_admin_key()
    return values


def replica_resources(device: str, cluster_gpus: float) -> dict[str, Any]:
    """A replica's Ray actor options for the engine's `device` setting: a GPU each where the
    engine is to run on one ("cuda", "cuda:N", or "auto" on a cluster that has GPUs; Ray
    shows an actor only the GPUs it asked for, so without one "auto" would find none and run
    on the CPU), none for "cpu". Asking for a GPU the cluster lacks would leave replicas
    pending for ever: refused instead."""
    wants_gpu = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
    if wants_gpu and cluster_gpus <= 0:
        raise ValueError(
            f"device {device!r}: the Ray cluster has no GPU; pass --device cpu or auto"
        )
    return {"num_cpus": 0, "num_gpus": 1} if wants_gpu else {"num_cpus": 0}


def _cluster_gpus() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0


def application(
    settings: Settings | dict[str, Any],
    *,
    num_replicas: int = 1,
    max_adapters: int | None = None,
    ray_actor_options: dict[str, Any] | None = None,
):
    """The Ray Serve application: `num_replicas` replicas of `LoraplexReplica`, each on a
    GPU of its own where the engine runs on one (`replica_resources`)."""
    serve = _serve()
    kwargs = replica_settings(settings) if isinstance(settings, Settings) else dict(settings)
    if ray_actor_options is None:
        ray_actor_options = replica_resources(kwargs.get("device", "auto"), _cluster_gpus())
        if ray_actor_options.get("num_gpus"):
            kwargs["device"] = "cuda"  # the one GPU Ray shows a replica is its cuda:0
    deployment = serve.deployment(
        serve.ingress()(LoraplexReplica),
        name=DEPLOYMENT_NAME,
        num_replicas=num_replicas,
        ray_actor_options=ray_actor_options,
        # A replica must not be torn down while its engine still loads the model.
        health_check_timeout_s=60,
    )
    return deployment.bind(kwargs, max_adapters)


def build_app(args: dict[str, str]):
    """`serve run loraplex.platform.ray_serve:build_app num_replicas=2 [max_adapters=32]`;
    every other setting comes from `LORAPLEX_*` / `LORAPLEX_CONFIG` as for `loraplex serve`."""
    args = dict(args)
    replicas = int(args.pop("num_replicas", 1))
    max_adapters = int(args["max_adapters"]) if "max_adapters" in args else None
    args.pop("max_adapters", None)
    if args:
        raise ValueError(f"unknown arguments {sorted(args)}: use num_replicas, max_adapters")
    return application(Settings(), num_replicas=replicas, max_adapters=max_adapters)


def run(settings: Settings, *, num_replicas: int) -> None:
    """`loraplex serve --ray`: join the cluster at RAY_ADDRESS (or start a local one) and
    serve on settings.host:port until interrupted."""
    if num_replicas < 1:
        raise ValueError(f"--replicas {num_replicas}: give 1 or more")
    serve = _serve()
    import ray

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # a local cluster inherits it
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    values = replica_settings(settings)
    if settings.admin_key is None:
        print(f"admin key (dev mode, shown once): {values['admin_key']}", flush=True)
    serve.run(
        application(values, num_replicas=num_replicas),
        name=APP_NAME,
        route_prefix="/",
        blocking=True,
    )
