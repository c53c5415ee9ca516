"""`/metrics`' `loraplex_adapter_load_seconds{tier}`: the engine's own histogram of each adapter
request's wait for its adapter, by the tier it was in, rendered as a Prometheus histogram."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.stats import ADAPTER_LOAD_BUCKETS, AdapterLoads, EngineStats
from loraplex.platform.metrics import Metrics


def test_adapter_load_histogram_by_tier():
    loads = AdapterLoads()
    for name, tier, seconds in (("1/a", "device", 0.0), ("1/a", "host", 0.003),
                                ("2/b", "disk", 0.2), ("2/b", "disk", 20.0)):  # fmt: skip
        loads.record(name, tier, seconds)
    stats = EngineStats(adapter_load_buckets=loads.buckets, adapter_load_sum=loads.sums,
                        cold_adapters=loads.top())  # fmt: skip
    assert [(c["adapter"], c["loads"], c["from_disk"]) for c in stats.cold_adapters] == [
        ("2/b", 2, 2), ("1/a", 1, 0)]  # fmt: skip
    m = Metrics()
    assert "loraplex_adapter_load_seconds" not in generate_latest(m.registry).decode()
    m.refresh(stats)
    text = generate_latest(m.registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "loraplex_adapter_load_seconds"]  # fmt: skip
    assert family.type == "histogram"
    got = {(s.name, s.labels["tier"], s.labels.get("le")): s.value for s in family.samples}
    top = str(ADAPTER_LOAD_BUCKETS[-1])
    assert got[("loraplex_adapter_load_seconds_count", "disk", None)] == 2
    assert got[("loraplex_adapter_load_seconds_sum", "disk", None)] == 20.2
    assert got[("loraplex_adapter_load_seconds_bucket", "disk", top)] == 1  # 20 s is above
    assert got[("loraplex_adapter_load_seconds_bucket", "disk", "+Inf")] == 2
    assert got[("loraplex_adapter_load_seconds_bucket", "host", "0.0025")] == 0
    assert got[("loraplex_adapter_load_seconds_bucket", "host", "0.005")] == 1
    assert got[("loraplex_adapter_load_seconds_bucket", "device", "0.0005")] == 1
