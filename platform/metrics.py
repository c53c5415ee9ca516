"""Prometheus metrics of one server process, on a registry of its own (bounded labels only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
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
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds",
            "TPOT",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.latency = Histogram(
            "loraplex_request_latency_seconds", "End-to-end latency", buckets=_LATENCY, registry=r
        )
        self.uploads = Counter(
            "loraplex_adapter_uploads", "Adapter uploads", ["status"], registry=r
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
        self.adapter_slots = Gauge(
            "loraplex_adapter_slots_used", "Device adapter slots used", registry=r
        )
        self.preemptions = Gauge("loraplex_preemptions", "Sequences preempted", registry=r)
        self.model_loaded = Gauge("loraplex_model_loaded", "1 when the model is ready", registry=r)
        self.weight_bytes = Gauge(
            "loraplex_model_weight_bytes",
            "Resident base-model weight bytes (after quantization; no KV cache, no adapters)",
            registry=r,
        )

    def refresh(self, stats) -> None:
        """Copy the engine's counters into gauges (at scrape time)."""
        if stats is None:
            return
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.adapter_hits.set(stats.adapter_hits)
        self.adapter_loads.set(stats.adapter_loads)
        self.adapter_slots.set(stats.adapter_slots_used)
        self.preemptions.set(stats.preemptions)
