"""`loraplex agent`: the adapter agent (agent.py) as a small HTTP service in a vLLM pod.

The platform's vLLM data plane asks it, before the first request of an adapter version on
that pod, to make the version loadable there:

    POST /v1/ensure {"name": <vLLM name>, "key": <store key>, "digest": <sha256>}
        200 loaded; 422 the adapter cannot be served by vLLM (the detail says why);
        503 the store or vLLM did not answer (retry)
    GET  /healthz

It reads the adapter store the platform writes (the same LORAPLEX_STORE_URL / S3 settings)
and needs no database and no shared filesystem.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from loraplex.engine import AdapterError, AdapterUnavailable
from loraplex.platform.dataplane.agent import Agent
from loraplex.platform.store.base import check_digest, check_key


class Ensure(BaseModel):
    name: str
    key: str
    digest: str


def create_agent_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="loraplex agent")

    @app.post("/v1/ensure")
    async def ensure(body: Ensure) -> dict:
        try:
            check_key(body.key)
            check_digest(body.digest)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        try:
            await asyncio.to_thread(agent.ensure, body.name, body.key, body.digest)
        except AdapterError as e:
            raise HTTPException(422, str(e)) from None
        except AdapterUnavailable as e:
            raise HTTPException(503, str(e)) from None
        return {"loaded": body.name}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "vllm": agent.url, "adapters": len(agent.loaded())}

    return app
