"""`python -m benchmarks.cliff` on a tiny trace: both loraplex caches run it to the end, at the same
KV bytes, with the figures the table reports."""

from __future__ import annotations

import argparse

from benchmarks import cliff, cliff_trace


def test_trace_is_long_tailed_and_seeded():
    trace = cliff_trace.make_trace(400, 1.0, rate=2.0, num_adapters=3, vocab=512)
    outs = sorted(r["max_tokens"] for r in trace)
    assert outs[0] >= 1024 and outs[-1] <= 8192 and outs[len(outs) // 2] < 2048 < outs[-20]
    assert all(200 <= len(r["prompt"]) <= 400 for r in trace)
    assert {r["adapter"] for r in trace} == {0, 1, 2, None}
    assert trace == cliff_trace.make_trace(400, 1.0, rate=2.0, num_adapters=3, vocab=512)


def test_cliff_smoke(tiny_models, tmp_path, capsys):
    p = argparse.ArgumentParser()
    cliff.add_args(p)
    args = p.parse_args([
        "--model", str(tiny_models["llama"]), "--requests", "4", "--scale", "0.02",
        "--rate", "100", "--concurrency", "1", "4", "--adapters", "2", "--no-plot",
        "--systems", "loraplex", "loraplex-adm-int8", "loraplex-swap",
        "--out", str(tmp_path / "cliff.json"),
        "--cache", str(tmp_path / "cache"),
    ])  # fmt: skip
    doc = cliff.run_cliff(args)
    printed = capsys.readouterr().out
    assert "lengths x0.02" in printed and "| 4 | loraplex-adm-int8 |" in printed
    want = sum(r["max_tokens"] for r in cliff_trace.make_trace(
        4, 0.02, rate=100, num_adapters=2, vocab=512))  # fmt: skip
    rows = {(r["system"], r["concurrency"]): r for r in doc["rows"]}
    assert len(rows) == 6
    for r in rows.values():
        assert r["finished"] == 4 and r["generated"] == want and r["goodput_tok_s"] > 0
        assert r["kv_bytes"] <= doc["plan"]["bytes"] and r["recompute_ratio"] >= 0
        assert r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    auto, int8 = rows["loraplex", 4], rows["loraplex-adm-int8", 4]
    assert int8["kv_blocks"] >= 1.5 * auto["kv_blocks"]
    swap = rows["loraplex-swap", 4]  # a host pool: each preemption swapped or recomputed
    assert swap["kv_blocks"] == auto["kv_blocks"] and swap["prefill_s_per_token"] > 0
    assert swap["swapped_out"] + swap["recompute_preemptions"] >= swap["preemptions"]
