"""Where `loraplex bench serve` sends a trace: any OpenAI-compatible server.

    target = HTTPTarget(url, api_key, adapter_names, base_model)   # loraplex, vLLM, HF+peft …
    result = await target.send(request, t0)                        # one RequestResult
    await target.close()

The lab's in-process target (`EngineTarget` in benchmarks/replay_engine.py, run by
`python -m benchmarks.replay_engine`) has the same two methods, so both share the replay, the
metrics and the report.
"""

from __future__ import annotations

import httpx

from loraplex.bench.client import stream_completion
from loraplex.bench.metrics import RequestResult
from loraplex.bench.trace import TraceRequest


class HTTPTarget:
    """An OpenAI-compatible server; adapter k of the trace is the model `adapter_names[k]`."""

    kind = "http"

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        adapter_names: list[str],
        base_model: str,
        *,
        ignore_eos: bool = True,
        timeout_s: float = 600.0,
    ):
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.api_key = api_key
        self.adapter_names = adapter_names
        self.base_model = base_model
        self.ignore_eos = ignore_eos
        # No connection cap: the trace, not the client, decides how many requests are in flight.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    def model_for(self, req: TraceRequest) -> str:
        if req.adapter is None:
            return self.base_model
        if req.adapter >= len(self.adapter_names):
            raise ValueError(
                f"the trace uses adapter #{req.adapter} but only {len(self.adapter_names)} "
                "adapter names were given"
            )
        return self.adapter_names[req.adapter]

    async def send(self, req: TraceRequest, t0: float) -> RequestResult:
        return await stream_completion(
            self.client,
            f"{self.url}/completions",
            self.api_key,
            self.model_for(req),
            req,
            t0=t0,
            ignore_eos=self.ignore_eos,
        )

    async def close(self) -> None:
        await self.client.aclose()
