"""The trace generator: seeded, and its distributions are the configured ones."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import replace

import pytest

from loraplex.bench.trace import LengthDist, TraceConfig, make_trace, popularity, token_range

BIG = TraceConfig(
    num_requests=20_000,
    rate=5.0,
    num_adapters=8,
    alpha=1.0,
    input_len=LengthDist(1, 1),
    output_len=LengthDist(4, 4),
    vocab_size=1000,
)


def gaps(trace) -> list[float]:
    return [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:], strict=False)]


def test_same_seed_same_trace_other_seed_other_trace():
    cfg = TraceConfig(num_requests=50, input_len=LengthDist(2, 9), vocab_size=600)
    assert make_trace(cfg) == make_trace(cfg)
    other = make_trace(replace(cfg, seed=1))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in make_trace(cfg)]
    assert [r.prompt for r in other] != [r.prompt for r in make_trace(cfg)]


def test_poisson_gaps_have_the_rate_and_cv_one():
    g = gaps(make_trace(BIG))
    assert statistics.mean(g) == pytest.approx(1 / BIG.rate, rel=0.05)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.05)
    assert make_trace(BIG)[0].arrival_s == 0.0


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_gaps_have_the_rate_and_the_configured_cv(cv):
    g = gaps(make_trace(replace(BIG, arrival="gamma", cv=cv)))
    assert statistics.mean(g) == pytest.approx(1 / BIG.rate, rel=0.06)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    trace = make_trace(replace(BIG, num_requests=10, rate=math.inf))
    assert {r.arrival_s for r in trace} == {0.0}


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_adapter_popularity_follows_the_power_law(alpha):
    trace = make_trace(replace(BIG, alpha=alpha))
    counts = Counter(r.adapter for r in trace)
    assert set(counts) <= set(range(8))
    for k, p in enumerate(popularity(8, alpha)):
        assert counts[k] / len(trace) == pytest.approx(p, abs=0.015)
    if alpha > 0:
        assert counts[0] > counts[1] > counts[7]


def test_base_fraction_and_base_only_traces():
    trace = make_trace(replace(BIG, base_fraction=0.25))
    assert sum(r.adapter is None for r in trace) / len(trace) == pytest.approx(0.25, abs=0.015)
    assert all(r.adapter is None for r in make_trace(replace(BIG, num_adapters=0)))


def test_lengths_fixed_and_uniform():
    cfg = replace(BIG, num_requests=4000, input_len=LengthDist(3, 11), output_len=LengthDist(7, 7))
    trace = make_trace(cfg)
    ins = [len(r.prompt) for r in trace]
    assert {r.max_tokens for r in trace} == {7}
    assert set(ins) == set(range(3, 12))  # every length of the range, nothing outside
    assert statistics.mean(ins) == pytest.approx(7, rel=0.03)
    lo, hi = token_range(cfg.vocab_size)
    assert all(lo <= t < hi for r in trace for t in r.prompt)


def test_changing_the_adapter_count_keeps_arrivals_lengths_and_prompts():
    a = make_trace(replace(BIG, num_requests=200, num_adapters=4))
    b = make_trace(replace(BIG, num_requests=200, num_adapters=1024))
    assert [(r.arrival_s, r.prompt, r.max_tokens) for r in a] == [
        (r.arrival_s, r.prompt, r.max_tokens) for r in b
    ]
    assert max(r.adapter for r in b) >= 4  # the larger pool is used


def test_length_parsing_and_config_errors_say_what_to_fix():
    assert LengthDist.parse("64") == LengthDist(64, 64)
    assert LengthDist.parse("8:512") == LengthDist(8, 512)
    with pytest.raises(ValueError, match="LOW:HIGH"):
        LengthDist.parse("a:b")
    with pytest.raises(ValueError, match="low <= high"):
        LengthDist.parse("9:3")
    with pytest.raises(ValueError, match="poisson or gamma"):
        TraceConfig(arrival="weibull")
    with pytest.raises(ValueError, match="rate"):
        TraceConfig(rate=0)
