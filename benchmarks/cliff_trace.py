"""The cliff benchmark's trace and client loop, shared by loraplex and the vLLM worker.

Standard library only: benchmarks/cliff_vllm.py imports this file by path under the peer
virtualenv's python, where loraplex is not installed.

    trace     `n` requests: prompts uniform on [200, 400] tokens, outputs Pareto(alpha) on
              [1024, 8192] tokens (long-tailed: 44 % above 2k, 19 % above 4k at alpha 1.2),
              both times `scale`; Poisson arrivals; adapters drawn from a few plus the base
    drive     replays a trace against an engine's add / step with at most `concurrency`
              requests in flight (an arrival waits client-side for a free place), and times
              each request's first and last token
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

PROMPT = (200, 400)
OUTPUT = (1024, 8192)


def make_trace(n: int, scale: float, *, rate: float, num_adapters: int, vocab: int,
               alpha: float = 1.2, seed: int = 0) -> list[dict]:  # fmt: skip
    """[{"id", "arrival" (s), "prompt" [ids], "adapter" (index or None), "max_tokens"}]."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        plen = max(1, round(rng.randint(*PROMPT) * scale))
        olen = min(OUTPUT[1], OUTPUT[0] * rng.random() ** (-1 / alpha))
        adapter = rng.randrange(num_adapters + 1)  # the last choice: the base model
        out.append({
            "id": f"r{i}", "arrival": t,
            "prompt": [rng.randrange(5, vocab) for _ in range(plen)],
            "adapter": None if adapter == num_adapters else adapter,
            "max_tokens": max(1, round(olen * scale)),
        })  # fmt: skip
    return out


def warmup(trace: list[dict]) -> dict:
    """A short request run before the measured ones (first steps are slow), on a prompt no
    trace request shares a prefix with."""
    return {"id": "warmup", "arrival": 0.0, "prompt": trace[0]["prompt"][::-1], "adapter": 0,
            "max_tokens": 16}  # fmt: skip


def drive(
    trace: list[dict],
    concurrency: int,
    add: Callable[[dict], None],
    step: Callable[[], list[tuple[str, int, bool]]],
    cap_s: float,
) -> dict:
    """Run until every request finished or `cap_s` passed. `step` returns (id, output tokens
    so far, finished) for the requests that moved. Returns per-request records and the wall
    time: {"seconds", "requests": {id: {"prompt", "arrival", "added", "first", "done",
    "tokens"}}}."""
    start = time.perf_counter()
    pending = sorted(trace, key=lambda r: r["arrival"])
    recs = {r["id"]: {"prompt": len(r["prompt"]), "arrival": r["arrival"], "added": None,
                      "first": None, "done": None, "tokens": 0} for r in trace}  # fmt: skip
    in_flight = 0
    while True:
        now = time.perf_counter() - start
        if now > cap_s or (not pending and in_flight == 0):
            break
        while pending and in_flight < concurrency and pending[0]["arrival"] <= now:
            req = pending.pop(0)
            recs[req["id"]]["added"] = now
            add(req)
            in_flight += 1
        if in_flight == 0:
            time.sleep(min(0.01, max(0.0, pending[0]["arrival"] - now)))
            continue
        moved = step()
        now = time.perf_counter() - start
        for rid, tokens, finished in moved:
            rec = recs[rid]
            if tokens and rec["first"] is None:
                rec["first"] = now
            rec["tokens"] = tokens
            if finished and rec["done"] is None:
                rec["done"] = now
                in_flight -= 1
    return {"seconds": time.perf_counter() - start, "requests": recs}


def summarize(run: dict, computed_tokens: int | None, preemptions: int | None) -> dict:
    """Goodput (output tokens of finished requests / wall s), p50/p99 TPOT of finished
    requests, tokens recomputed / tokens generated (tokens run through the model beyond each
    prompt and output token once; None when the engine does not count them)."""
    reqs = list(run["requests"].values())
    done = [r for r in reqs if r["done"] is not None]
    tpots = sorted((r["done"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1)

    def pct(q: float) -> float | None:
        return tpots[min(len(tpots) - 1, int(q * len(tpots)))] if tpots else None

    generated = sum(r["tokens"] for r in reqs)
    # Each token once: the prompt and the output. (The last output token is never fed back,
    # but vLLM's step counts show one token more per request than that: counted as once.)
    once = sum(r["prompt"] + r["tokens"] for r in reqs if r["added"] is not None)
    recomputed = None if computed_tokens is None else max(0, computed_tokens - once)
    return {
        "seconds": run["seconds"],
        "finished": len(done),
        "requests": len(reqs),
        "goodput_tok_s": sum(r["tokens"] for r in done) / run["seconds"],
        "generated": generated,
        "computed": computed_tokens,
        "recomputed": recomputed,
        "recompute_ratio": None if recomputed is None else recomputed / max(1, generated),
        "preemptions": preemptions,
        "tpot_p50_ms": None if pct(0.5) is None else pct(0.5) * 1e3,
        "tpot_p99_ms": None if pct(0.99) is None else pct(0.99) * 1e3,
    }
