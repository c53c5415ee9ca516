"""`python -m benchmarks.fleet`: the router's choices, and a tiny fleet of real engines whose cold
loads the bench counts exactly as the adapter managers do."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import fleet
from benchmarks.fleet_router import ReplicaView, Router
from loraplex.bench.trace import TraceRequest
from loraplex.engine.stats import EngineStats


def _view(queue: int = 0, *, slots=(), host=(), waiting=(), used=None) -> ReplicaView:
    used = len(slots) if used is None else used
    stats = EngineStats(resident_adapters=list(slots), host_adapters=list(host),
                        waiting_adapters=list(waiting), adapters_in_host=len(host),
                        adapter_slots=2, adapter_slots_used=used)  # fmt: skip
    return ReplicaView(stats, max_cpu_loras=4, in_flight={"other": queue} if queue else {})


def test_round_robin_and_least_queue():
    rr = Router("round-robin", 3)
    assert [rr.pick([_view()] * 3, "a") for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    lq = Router("least-queue", 3)
    assert lq.pick([_view(3), _view(1), _view(2, slots=["a"])], "a") == 1


def test_affinity_prefers_the_holder_until_its_queue_is_much_longer():
    r = Router("affinity", 2, queue_tolerance=4)
    holder = _view(2, slots=["a"])
    assert r.pick([_view(0, used=2), holder], "a") == 1  # the other's slots are full
    assert r.pick([_view(0), holder], "a") == 1  # 1.0 - 2/4 beats 0.5 (room)
    assert r.pick([_view(0), _view(5, slots=["a"])], "a") == 0  # 5 queued: spill over
    # Requests still queued or routed a moment ago count as "it will be there".
    assert r.pick([_view(0), _view(1, waiting=["a"])], "a") == 1
    sent = ReplicaView(EngineStats(adapter_slots=2), 4, in_flight={"a": 1})
    assert r.pick([_view(0, used=2), sent], "a") == 1


def test_only_affinity_host_sees_the_host_tier():
    views = [_view(0, used=2), _view(1, host=["a"], used=2)]
    assert Router("affinity", 2, queue_tolerance=4).pick(views, "a") == 0  # not in /metrics
    assert Router("affinity-host", 2, queue_tolerance=4).pick(views, "a") == 1


def _args(model, tmp_path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    fleet.add_args(p)
    return p.parse_args(["--model", str(model), "--quick", "--no-plot", "--out",
                         str(tmp_path / "fleet.json"), "--cache", str(tmp_path / "cache"),
                         *extra])  # fmt: skip


def test_quick_fleet_runs_every_request(tiny_models, tmp_path, capsys):
    args = _args(tiny_models["llama"], tmp_path, "--policies", "round-robin", "affinity-host")
    doc = fleet.run_fleet(args)
    printed = capsys.readouterr().out
    assert "| round-robin |" in printed and "affinity-host vs round-robin" in printed
    assert json.loads((tmp_path / "fleet.json").read_text())["rows"] == doc["rows"]
    assert doc["replicas"] == 2 and doc["adapters"] == 16
    for r in doc["rows"]:
        assert r["finished"] == r["requests"] == 40
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["output_tok_s"] > 0
        assert 0 <= r["cold_loads"] <= r["load_waits"] <= 40


def _paired_trace(num_adapters: int, passes: int, gap_s: float) -> list[TraceRequest]:
    """Each adapter twice in a row, every pass: round-robin sends the two requests of a pair
    to both replicas, so every replica loads every adapter."""
    order = [k for _ in range(passes) for k in range(num_adapters) for _ in range(2)]
    return [TraceRequest(i, i * gap_s, k, [5 + (i * 7 + j) % 500 for j in range(8)], 4)
            for i, k in enumerate(order)]  # fmt: skip


@pytest.mark.parametrize("policy", ["round-robin", "affinity-host"])
def test_cold_loads_match_the_adapter_managers(policy, tiny_models, tmp_path):
    args = _args(tiny_models["llama"], tmp_path, "--max-cpu-loras", "16")
    fleet.apply_quick(args, keep=frozenset({"max_cpu_loras"}))
    model = tiny_models["llama"]
    adapters = fleet.make_adapters(model, model.name, 16, cache=args.cache)
    trace = _paired_trace(16, 2, 0.05)
    row, records, counts = fleet.run_policy(policy, model, adapters, ([], trace), args)
    run = records["run"]
    assert [r["index"] for r in run] == list(range(64))
    assert all(r["tokens"] == 4 and r["finish_reason"] == "length" for r in run)
    # The host tier holds all 16: each replica reads each adapter it serves exactly once.
    pairs = {(r["replica"], r["adapter"]) for r in run}
    assert row["cold_loads"] == row["cold_loads_total"] == sum(counts["managers"]) == len(pairs)
    if policy == "round-robin":
        assert len(pairs) == 32  # both replicas served every adapter
    else:
        assert len(pairs) < 32  # second requests of pairs followed their adapter


def test_replicas_fetch_from_a_real_s3_server_once_per_adapter(tiny_models, tmp_path):
    """--store moto: each replica fetches an adapter into its own disk cache the first time it
    serves it (a real moto S3 server over HTTP), and its engine reads that copy."""
    from benchmarks.fleet_store import open_store

    args = _args(tiny_models["llama"], tmp_path, "--max-cpu-loras", "16", "--store", "moto")
    fleet.apply_quick(args, keep=frozenset({"max_cpu_loras"}))
    model = tiny_models["llama"]
    adapters = fleet.make_adapters(model, model.name, 16, cache=args.cache)
    trace = _paired_trace(16, 2, 0.05)
    with open_store(args, adapters) as store:
        row, records, counts = fleet.run_policy(
            "round-robin", model, adapters, ([], trace), args, store
        )
        on_disk = [sorted(p.name for p in c.dir.iterdir() if p.name != ".partial")
                   for c in store.caches]  # fmt: skip
    run = records["run"]
    assert all(r["tokens"] == 4 and r["finish_reason"] == "length" for r in run)
    pairs = {(r["replica"], r["adapter"]) for r in run}
    assert len(pairs) == 32 and row["store_fetches"] == 32 == row["cold_loads"]
    assert row["fetch_ms_mean"] > 0
    assert [len(d) for d in on_disk] == [16, 16]
    assert all(r["fetch_s"] > 0 for r in run)  # every request went through its cache
