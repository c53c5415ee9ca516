"""Metrics: percentiles, and TTFT/TPOT/E2E read from a fake stream with known timings."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from loraplex.bench.client import consume_sse
from loraplex.bench.metrics import SLO, RequestResult, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def result(start: float = 0.1) -> RequestResult:
    return RequestResult(
        index=0, adapter=1, prompt_tokens=5, max_tokens=4, scheduled_s=start, start_s=start
    )


def sse(*objs) -> list[str]:
    lines = []
    for o in objs:
        lines += [f"data: {o if isinstance(o, str) else json.dumps(o)}", ""]
    return lines


def chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def replay_stream(lines: list[str], times: list[float], res: RequestResult) -> RequestResult:
    """Feed `lines`; the clock reads the next of `times` at each data line and at the end."""
    clock = iter(times)

    async def gen():
        for line in lines:
            yield line

    asyncio.run(consume_sse(gen(), res, lambda: next(clock)))
    return res


def test_ttft_tpot_e2e_from_a_stream_with_known_timings():
    lines = sse(
        chunk("a"),
        chunk("b"),
        chunk("c"),
        chunk("d", "length"),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
        "[DONE]",
    )
    #            a    b    c    d    usage end
    times = [0.5, 0.6, 0.8, 1.1, 1.15, 1.2]
    r = replay_stream(lines, times, result(start=0.1))
    assert r.ok and r.output_tokens == 4 and r.usage_prompt_tokens == 5
    assert r.ttft == pytest.approx(0.4)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.e2e == pytest.approx(1.1)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.finish_reason == "length"


def test_without_usage_tokens_are_counted_from_chunks_and_the_closing_chunk_is_not_one():
    lines = sse(chunk("x"), chunk("y"), chunk("", "length"), "[DONE]")
    r = replay_stream(lines, [1.0, 2.0, 2.5, 3.0], result(start=0.0))
    assert r.output_tokens == 2
    assert r.token_times == [1.0, 2.0]
    assert r.tpot == pytest.approx(1.0)


def test_an_error_event_makes_the_request_an_error():
    lines = sse(chunk("x"), {"error": {"message": "boom", "code": "internal"}})
    r = replay_stream(lines, [1.0, 2.0], result(start=0.0))
    assert not r.ok and "boom" in r.error


def done(i: int, start: float, first: float, end: float, tokens: int) -> RequestResult:
    r = RequestResult(
        index=i, adapter=None, prompt_tokens=3, max_tokens=tokens, scheduled_s=start, start_s=start
    )
    r.first_token_s, r.end_s, r.output_tokens = first, end, tokens
    r.token_times = [first + k * (end - first) / max(tokens - 1, 1) for k in range(tokens)]
    return r


def test_summary_throughput_latencies_errors_and_slo():
    ok = [done(0, 0.0, 0.2, 1.0, 5), done(1, 1.0, 1.5, 3.0, 11), done(2, 2.0, 2.1, 4.0, 20)]
    bad = RequestResult(
        index=3,
        adapter=0,
        prompt_tokens=3,
        max_tokens=4,
        scheduled_s=2.5,
        start_s=2.5,
        end_s=2.6,
        error="http 429: too many requests",
    )
    s = summarize([*ok, bad], SLO(ttft_s=0.3))
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["error_kinds"] == {"http 429": 1}
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["output_tokens"] == 36 and s["output_throughput"] == pytest.approx(9.0)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["ttft"]["max"] == pytest.approx(0.5)
    assert s["e2e"]["p50"] == pytest.approx(2.0)
    assert s["tpot"]["p50"] == pytest.approx(0.15)  # (3.0 - 1.5) / 10
    # TTFT 0.2 and 0.1 meet 0.3 s, 0.5 misses it, the error fails: 2 of 4.
    assert s["slo"]["attainment"] == pytest.approx(0.5)
