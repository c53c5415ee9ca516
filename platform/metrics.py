"""Prometheus metrics of one server process, on a registry of its own.

Two families side by side:

- `loraplex_*`: ours. Bounded labels only (never tenant names or ids), except the served
  adapter names of `loraplex_adapter_version_requests`, under the same switch as vLLM's.
- `vllm:*`: the model-server protocol a LoRA-aware router reads (the Gateway API Inference
  Extension's endpoint picker, llm-d), under vLLM's names and meanings: queue depth, KV use,
  the cache geometry, and which adapters a replica holds. `vllm:lora_requests_info` reports
  residency, not request states: `running_lora_adapters` are the adapters in a device slot
  now, `waiting_lora_adapters` those with requests queued that are not in a slot (loading
  from the store, or in host memory waiting for a slot). Its labels carry served adapter
  names (what a tenant puts in `model`, the only name a router can match), so they are
  bounded by `max_lora` + the queue, and `/metrics` is for operators: see docs/fleet.md.
  Beside them, `loraplex:lora_host_adapters_info` lists (same rules) the adapters in host
  memory: a router that weighs them too keeps an adapter on the replica that can put it in a
  slot without reading the store (`python -m benchmarks.fleet`'s affinity-host: far fewer cold
  loads than round-robin where slot lists alone gave none; docs/fleet.md).
  Speculative decoding's counters too (`vllm:spec_decode_*`): drafts (one request's proposals
  scored in one step), draft tokens, accepted tokens, and accepted tokens per position.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from loraplex.engine import ADAPTER_LOAD_BUCKETS

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, *, adapter_names: bool = True) -> None:
        # Off: `vllm:lora_requests_info` carries empty adapter lists (no router affinity then).
        self.adapter_names = adapter_names
        # Held from refresh to rendering: a concurrent scrape never sees a half-swapped series.
        self.lock = threading.Lock()
        r = self.registry = CollectorRegistry()
        # Labels: route (fixed set), status (ok|aborted|error|rejected). Never tenant or adapter
        # names: those are unbounded.
        self.requests = Counter(
            "loraplex_requests", "Inference requests", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter(
            "loraplex_completion_tokens", "Generated tokens", registry=r
        )
        # Interactive requests only: the latency alerts and dashboards (helm/) read these, and
        # a Batch API line waits for idle capacity by design. A line's end-to-end time goes to
        # `loraplex_batch_request_latency_seconds`.
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "TTFT of interactive requests",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds",
            "TPOT of interactive requests",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.batch_latency = Histogram(
            "loraplex_batch_request_latency_seconds",
            "End-to-end latency of Batch API lines",
            buckets=_LATENCY + (300, 900, 3600),
            registry=r,
        )
        self.latency = Histogram(
            "loraplex_request_latency_seconds",
            "End-to-end latency of interactive requests",
            buckets=_LATENCY,
            registry=r,
        )
        self.uploads = Counter(
            "loraplex_adapter_uploads", "Adapter uploads", ["status"], registry=r
        )
        # Which version of an adapter answered, for watching a canary split. Labelled by the
        # served name and version only, as `vllm:lora_requests_info` is: no tenant id, which an
        # operator's Prometheus must not hold (docs/security.md) and which would multiply the
        # series by tenants; two tenants' adapters of one name share a series (the ledger splits
        # them: `loraplex usage summary --group-by version`). Only with `adapter_names` on.
        self.version_requests = Counter(
            "loraplex_adapter_version_requests",
            "Requests answered per served adapter name and version",
            ["adapter", "version"],
            registry=r,
        )
        self.running = Gauge("loraplex_running_requests", "Requests running", registry=r)
        self.waiting = Gauge("loraplex_waiting_requests", "Requests queued", registry=r)
        self.kv_usage = Gauge("loraplex_kv_cache_usage_ratio", "KV blocks held", registry=r)
        self.adapter_hits = Gauge(
            "loraplex_adapter_cache_hits", "Adapter host-cache hits", registry=r
        )
        self.adapter_loads = Gauge(
            "loraplex_adapter_loads", "Adapters loaded from disk", registry=r
        )
        self.adapter_load_failures = Gauge(
            "loraplex_adapter_load_failures", "Adapter loads that failed", registry=r
        )
        self.adapter_slots = Gauge(
            "loraplex_adapter_slots_used", "Device adapter slots used", registry=r
        )
        self.preemptions = Gauge("loraplex_preemptions", "Sequences preempted", registry=r)
        self.kv_swaps = Gauge(
            "loraplex_kv_swaps",
            "Preempted sequences whose KV blocks went to the host pool (out) and back (in)",
            ["direction"],
            registry=r,
        )
        # KV tiers (engine/memory/tiers): hit rate = hit / queried per tier (docs/kv-tiers.md).
        self.kv_tier_blocks = Gauge(
            "loraplex_kv_tier_blocks",
            "Prefix KV blocks looked up in each tier (queried) and found there (hit)",
            ["tier", "kind"],
            registry=r,
        )
        self.kv_tier_bytes = Gauge(
            "loraplex_kv_tier_bytes",
            "KV tier bytes read and written since start, and held now (stored)",
            ["tier", "kind"],
            registry=r,
        )
        self.model_loaded = Gauge("loraplex_model_loaded", "1 when the model is ready", registry=r)
        # Set once at start, from the engine's MemoryReport (its start log line says the same).
        self.weight_bytes = Gauge(
            "loraplex_model_weight_bytes",
            "Resident base-model weight bytes (after quantization; no KV cache, no adapters)",
            ["quantization"],
            registry=r,
        )
        self.kv_capacity = Gauge(
            "loraplex_kv_cache_capacity_tokens", "Tokens the KV pool holds", registry=r
        )
        self.kv_bytes = Gauge("loraplex_kv_cache_bytes", "Bytes of the KV pool", registry=r)
        self.device = Gauge(
            "loraplex_engine_device_info",
            "1, labelled with where the engine runs (cpu, or cuda:N with the GPU's name)",
            ["device"],
            registry=r,
        )
        self.adapter_capacity = Gauge(
            "loraplex_adapter_slots",
            "Adapters that fit per tier (device: slots of max_lora_rank; host: the LRU's size)",
            ["tier"],
            registry=r,
        )

        # The model-server protocol (vLLM's names; `:` is legal in Prometheus names).
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed", registry=r
        )
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches", registry=r
        )
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", registry=r
        )
        self.vllm_cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration (value 1)",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )
        self.vllm_lora_info = Gauge(
            "vllm:lora_requests_info",
            "Adapters resident in device slots (running) and queued for a slot (waiting); "
            "value: the snapshot's Unix time",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self.host_lora_info = Gauge(
            "loraplex:lora_host_adapters_info",
            "Adapters in host memory (a slot load away from running); value: the snapshot's "
            "Unix time",
            ["host_lora_adapters"],
            registry=r,
        )
        self.adapters_resident = Gauge(
            "loraplex_adapters_resident",
            "Adapters held per memory tier (device: in a slot; host: in host memory, which "
            "also backs every device-resident adapter)",
            ["tier"],
            registry=r,
        )
        self.adapters_waiting = Gauge(
            "loraplex_adapters_waiting",
            "Adapters with queued requests that are not in a device slot",
            registry=r,
        )
        self.stats = None  # the engine snapshot of the latest refresh
        r.register(_SpecDecodeCollector(self))
        r.register(_AdapterLoadCollector(self))

    def set_memory(self, memory) -> None:
        """The engine's MemoryReport (engine/memory/budget.py), at start."""
        self.weight_bytes.clear()
        self.weight_bytes.labels(memory.quantization or "none").set(memory.weight_bytes)
        self.kv_capacity.set(memory.kv_cache_tokens)
        self.kv_bytes.set(memory.kv_cache_bytes)
        self.device.clear()
        self.device.labels(memory.device or "unknown").set(1)
        self.adapter_capacity.labels("device").set(memory.adapter_slots)
        self.adapter_capacity.labels("host").set(memory.host_adapters)

    def refresh(self, stats) -> None:
        """Copy the engine's snapshot into gauges (at scrape time)."""
        if stats is None:
            return
        self.stats = stats
        self.vllm_waiting.set(stats.waiting)
        self.vllm_running.set(stats.running)
        self.vllm_kv_usage.set(stats.kv_usage)
        # One series each: a changed label set replaces the old one instead of piling up.
        self.vllm_cache_config.clear()
        self.vllm_cache_config.labels(str(stats.block_size), str(stats.kv_blocks)).set(1)
        running = served_names(stats.resident_adapters) if self.adapter_names else []
        waiting = served_names(stats.waiting_adapters) if self.adapter_names else []
        self.vllm_lora_info.clear()
        self.vllm_lora_info.labels(
            str(stats.adapter_slots), ",".join(running), ",".join(waiting)
        ).set(time.time())
        host = served_names(stats.host_adapters) if self.adapter_names else []
        self.host_lora_info.clear()
        self.host_lora_info.labels(",".join(host)).set(time.time())
        self.adapters_resident.labels("device").set(len(stats.resident_adapters))
        self.adapters_resident.labels("host").set(stats.adapters_in_host)
        self.adapters_waiting.set(len(stats.waiting_adapters))
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.adapter_hits.set(stats.adapter_hits)
        self.adapter_loads.set(stats.adapter_loads)
        self.adapter_load_failures.set(stats.adapter_load_failures)
        self.adapter_slots.set(stats.adapter_slots_used)
        self.preemptions.set(stats.preemptions)
        self.kv_swaps.labels("out").set(stats.swapped_out)
        self.kv_swaps.labels("in").set(stats.swapped_in)
        for kind, per_tier in (("queried", stats.kv_tier_queried), ("hit", stats.kv_tier_hits)):
            for tier, n in per_tier.items():
                self.kv_tier_blocks.labels(tier, kind).set(n)
        for kind, per_tier in (("read", stats.kv_tier_bytes_read),
                               ("written", stats.kv_tier_bytes_written),
                               ("stored", stats.kv_tier_bytes_stored)):  # fmt: skip
            for tier, n in per_tier.items():
                self.kv_tier_bytes.labels(tier, kind).set(n)


def served_names(engine_names: list[str]) -> list[str]:
    """The names tenants serve adapters under, from the engine's `<tenant id>/<name>@v<n>`: sorted,
    once each (two tenants' adapters of one name are one name to a router)."""
    return sorted({n.split("/", 1)[-1].split("@", 1)[0] for n in engine_names})


class _SpecDecodeCollector:
    """vLLM's speculative-decoding counters, read from the engine's own running totals (a
    Counter we `inc` would drift from them)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # registered unchecked: names come from collect()

    def collect(self):
        s = self.metrics.stats
        if s is None:
            return
        for name, doc, value in (
            ("drafts", "Speculative drafts scored", s.spec_drafts),
            ("draft_tokens", "Speculative tokens proposed", s.spec_draft_tokens),
            ("accepted_tokens", "Speculative tokens accepted", s.spec_accepted_tokens),
        ):
            yield CounterMetricFamily(f"vllm:spec_decode_num_{name}", doc, value=value)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative tokens per position in the draft",
            labels=["position"],
        )
        for j, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([str(j)], n)
        yield per_pos


class _AdapterLoadCollector:
    """`loraplex_adapter_load_seconds{tier}`: each adapter request's wait for its adapter, by
    the tier it was in when the request arrived (device: none, host: a slot write, disk: the
    read and the write), from the engine's own histogram (engine/stats.py AdapterLoads)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        s = self.metrics.stats
        if s is None or not s.adapter_load_buckets:
            return
        family = HistogramMetricFamily(
            "loraplex_adapter_load_seconds",
            "Wait for the request's adapter, by the tier it was in",
            labels=["tier"],
        )
        bounds = [str(b) for b in ADAPTER_LOAD_BUCKETS] + ["+Inf"]
        for tier, counts in s.adapter_load_buckets.items():
            running, buckets = 0, []
            for bound, n in zip(bounds, counts, strict=True):
                running += n
                buckets.append((bound, running))
            family.add_metric([tier], buckets, s.adapter_load_sum.get(tier, 0.0))
        yield family
