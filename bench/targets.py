"""Where a trace goes: any OpenAI-compatible server, or our engine in-process (no HTTP).

    target = HTTPTarget(url, api_key, adapter_names, base_model)   # loraplex, vLLM, HF+peft …
    target = EngineTarget.build(model_dir, adapter_dirs, ...)      # `loraplex bench offline`
    result = await target.send(request, t0)                        # one RequestResult
    await target.close()

Both produce the same RequestResult, so `bench serve` and `bench offline` share the replay,
the metrics and the report.
"""

from __future__ import annotations

import time
from pathlib import Path

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


class EngineTarget:
    """Our AsyncLLMEngine in this process: the same trace without HTTP, auth or the registry."""

    kind = "engine"

    def __init__(self, engine, adapter_dirs: list[Path]):
        from loraplex.engine import LoRARequest

        self.engine = engine
        self.loras = [LoRARequest(f"a{i:04d}", i + 1, str(p)) for i, p in enumerate(adapter_dirs)]

    @classmethod
    def build(cls, model_dir: Path, adapter_dirs: list[Path], **config) -> EngineTarget:
        """`config`: EngineConfig options (dtype, max_loras, max_num_seqs, …)."""
        from loraplex.engine import AsyncLLMEngine, EngineConfig, LLMEngine

        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(model_dir), **config)))
        return cls(engine, adapter_dirs)

    async def send(self, req: TraceRequest, t0: float) -> RequestResult:
        from loraplex.engine import SamplingParams

        def clock() -> float:
            return time.perf_counter() - t0

        result = RequestResult.sent(req, clock())
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        lora = None if req.adapter is None else self.loras[req.adapter]
        last = None
        try:
            async for out in self.engine.generate(list(req.prompt), params, lora_request=lora):
                now = clock()
                if out.delta_token_ids:
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.token_times.append(now)
                last = out
        except Exception as e:  # a bad request must not end the run: it is counted instead
            result.error = f"{type(e).__name__}: {e}"
        result.end_s = clock()
        if last is not None:
            result.output_tokens = len(last.outputs[0].token_ids)
            result.finish_reason = last.outputs[0].finish_reason
            result.usage_prompt_tokens = len(req.prompt)
        return result

    async def close(self) -> None:
        self.engine.shutdown()
