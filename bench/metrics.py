"""Per-request timings of a serving run, and their summary.

    TTFT   time to first token: first streamed token - request sent
    TPOT   time per output token after the first: (last token - first token) / (tokens - 1)
    E2E    end-to-end latency: response complete - request sent
    ITL    gaps between successive streamed chunks (kept per request for the plots)

Throughput counts requests that completed without error: requests/s and output tokens/s over
the run's wall time (first send to last completion). SLO attainment is the share of *all*
requests (errors included, as failures) that met every latency bound given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    index: int
    adapter: int | None
    prompt_tokens: int  # tokens sent
    max_tokens: int
    scheduled_s: float  # the trace's arrival time
    start_s: float  # when the request was sent (run clock)
    first_token_s: float | None = None
    end_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per chunk carrying tokens
    output_tokens: int = 0  # the server's usage count when it gave one, else chunks seen
    usage_prompt_tokens: int | None = None  # the server's usage count, when given
    finish_reason: str | None = None
    error: str | None = None

    @classmethod
    def sent(cls, req, start_s: float) -> RequestResult:
        """The record of trace request `req` (a `trace.TraceRequest`), sent at `start_s`."""
        return cls(
            index=req.index,
            adapter=req.adapter,
            prompt_tokens=len(req.prompt),
            max_tokens=req.max_tokens,
            scheduled_s=req.arrival_s,
            start_s=start_s,
        )

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def tpot(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.first_token_s) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_s, r.ttft), (self.tpot_s, r.tpot), (self.e2e_s, r.e2e))
        # A bound on TPOT says nothing about one-token answers (no TPOT): they pass it.
        return all(bound is None or value is None or value <= bound for bound, value in checks)

    def describe(self) -> str:
        parts = [
            f"{name} <= {v * 1000:g} ms"
            for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s))
            if v is not None
        ]
        return " and ".join(parts) or "none"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q}: must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict:
    stats: dict = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    stats["mean"] = sum(values) / len(values) if values else None
    stats["max"] = max(values) if values else None
    return stats


def summarize(results: list[RequestResult], slo: SLO = SLO()) -> dict:
    """Counts, throughput and latency distributions (seconds) of one run."""
    ok = [r for r in results if r.ok]
    starts = [r.start_s for r in results]
    ends = [r.end_s for r in results if r.end_s is not None]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "no response").split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "e2e": distribution([r.e2e for r in ok if r.e2e is not None]),
        "itl": distribution([g for r in ok for g in r.itl]),
        "slo": {
            "ttft_s": slo.ttft_s,
            "tpot_s": slo.tpot_s,
            "e2e_s": slo.e2e_s,
            "attainment": (sum(slo.met(r) for r in results) / len(results)) if results else None,
        },
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def format_summary(s: dict) -> str:
    """The summary as a few human lines."""

    def num(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"requests: {s['completed']}/{s['requests']} completed, {s['errors']} errors"
        + (f" {s['error_kinds']}" if s["error_kinds"] else "")
        + f", {s['duration_s']:.2f} s",
        f"throughput: {num(s['request_throughput'])} req/s, "
        f"{num(s['output_throughput'], '.1f')} output tok/s "
        f"({s['output_tokens']} output, {s['prompt_tokens']} prompt tokens)",
        f"{'ms':6s} {'p50':>9s} {'p90':>9s} {'p99':>9s} {'mean':>9s}",
    ]
    for key in ("ttft", "tpot", "e2e"):
        d = s[key]
        lines.append(
            f"{key.upper():6s} "
            + " ".join(f"{_ms(d[k]):>9s}" for k in ("p50", "p90", "p99", "mean"))
        )
    slo = s["slo"]
    if any(slo[k] is not None for k in ("ttft_s", "tpot_s", "e2e_s")):
        bounds = SLO(slo["ttft_s"], slo["tpot_s"], slo["e2e_s"]).describe()
        lines.append(f"SLO ({bounds}): {num(slo['attainment'], '.1%')} attained")
    return "\n".join(lines)
