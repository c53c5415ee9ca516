"""Play a trace against a target on the trace's own clock (open loop).

Each request is sent at its arrival time whether or not earlier ones have finished, as users
would send them; a slow server therefore sees a growing queue instead of a slower client.
`max_concurrency` turns that into a closed loop when asked (requests wait for a free slot,
and their TTFT includes the wait, as a user's would).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Protocol

from loraplex.bench.metrics import RequestResult
from loraplex.bench.trace import TraceRequest


class Target(Protocol):
    async def send(self, req: TraceRequest, t0: float) -> RequestResult: ...


async def replay(
    target: Target,
    trace: list[TraceRequest],
    *,
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "requests",
) -> list[RequestResult]:
    """Results in trace order; `progress` shows a bar on stderr."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(trace), desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: TraceRequest) -> RequestResult:
        delay = req.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            res = await target.send(req, t0)
        else:
            async with gate:
                res = await target.send(req, t0)
            res.start_s = min(res.start_s, req.arrival_s)  # the wait for a slot counts
        if bar is not None:
            bar.update(1)
            if res.error:
                bar.set_postfix_str(f"last error: {res.error[:60]}")
        return res

    try:
        return list(await asyncio.gather(*(one(r) for r in trace)))
    finally:
        if bar is not None:
            bar.close()


def run_replay(target: Target, trace: list[TraceRequest], **kwargs) -> list[RequestResult]:
    """`replay` from synchronous code, closing the target afterwards."""

    async def main() -> list[RequestResult]:
        try:
            return await replay(target, trace, **kwargs)
        finally:
            await target.close()

    return asyncio.run(main())
