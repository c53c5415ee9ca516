"""`EngineStats`: what a server, a metrics scrape or a fleet router reads of a running engine.

A snapshot, taken on the engine's side without stopping its loop (plain reads of counters and
small lists; it may be one step stale). In process mode it crosses the pipe as a JSON dict now
and then, so every field is a number, a bool, a list (of adapter names, or of counts) or a
small dict of those (per tier; per adapter in `cold_adapters`).

Adapter residency is reported as it is, not as request states: `resident_adapters` hold a
device slot now, `host_adapters` are in host memory, `waiting_adapters` have requests queued
whose adapter is not in a slot (loading from disk, or loaded but not yet activated).

Adapter loads per request (`AdapterLoads`): every request with an adapter counts once, when
its first step has the adapter in a slot, under the tier the adapter was in when the request
arrived, with the time it waited for it (`RequestMetrics.adapter_load_time`). The snapshot
carries a histogram of those times per tier (`/metrics`' `loraplex_adapter_load_seconds`) and
the adapters with the most cold loads (tier host or disk), for the admin overview.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    paused: int = 0  # requests whose stream's reader fell behind: no steps, KV kept
    steps: int = 0  # steps that ran the model, since start
    generated_tokens: int = 0  # tokens sampled, since start
    kv_usage: float = 0.0  # fraction of KV blocks held
    kv_blocks: int = 0
    preemptions: int = 0
    swapped_out: int = 0  # preemptions by swap to the host KV pool (engine/memory/swap.py)
    swapped_in: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    adapter_hits: int = 0
    adapter_loads: int = 0
    adapters_in_host: int = 0
    adapter_slots_used: int = 0
    adapter_slots: int = 0
    alive: bool = True
    adapter_misses: int = 0  # requests that waited for a host load
    adapter_load_failures: int = 0
    adapter_load_seconds: float = 0.0
    adapters_loading: int = 0
    adapter_slot_writes: int = 0
    adapter_slot_bytes: int = 0  # device memory of the slots, out of the same budget as…
    kv_cache_bytes: int = 0  # …the KV pool
    block_size: int = 0
    kv_blocks_used: int = 0
    resident_adapters: list[str] = field(default_factory=list)  # in a device slot, slot order
    host_adapters: list[str] = field(default_factory=list)  # in host memory (LRU order)
    running_adapters: list[str] = field(default_factory=list)  # adapters of running requests
    waiting_adapters: list[str] = field(default_factory=list)  # queued, not in a slot
    # Speculative decoding (engine/sampling/speculative.py SpecDecodeStats), counters since start.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # Adapter loads per request, by tier (AdapterLoads): per tier, the count in each of
    # ADAPTER_LOAD_BUCKETS' buckets (not cumulative; the last is above the highest bound) and
    # the summed seconds; and the adapters with the most cold loads, most first.
    adapter_load_buckets: dict[str, list[int]] = field(default_factory=dict)
    adapter_load_sum: dict[str, float] = field(default_factory=dict)
    cold_adapters: list[dict] = field(default_factory=list)
    # KV tiers below the device pool (engine/memory/tiers), per tier (host, disk, shared),
    # since start: prefix blocks asked for and found, bytes read and written; bytes held now
    # (host, disk); prompt tokens loaded from the tiers instead of prefilled.
    kv_tier_queried: dict[str, int] = field(default_factory=dict)
    kv_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_tier_bytes_read: dict[str, int] = field(default_factory=dict)
    kv_tier_bytes_written: dict[str, int] = field(default_factory=dict)
    kv_tier_bytes_stored: dict[str, int] = field(default_factory=dict)
    kv_tier_tokens_loaded: int = 0


# Upper bounds (seconds) of the adapter-load histogram: wide enough for a slot write of a
# small adapter at one end and a read of a large one from a slow disk at the other.
ADAPTER_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0)  # fmt: skip
TIERS = ("device", "host", "disk")
COLD_TOP = 20  # adapters in a snapshot's `cold_adapters`


class AdapterLoads:
    """Every adapter request's load, by tier, and the cold ones per adapter. The engine
    thread records; a snapshot may read from another thread (AsyncLLMEngine.stats), so reads
    copy first and the top list is tagged with the count it was made from. One entry per
    adapter name served since start: bounded by what the replica serves, a few numbers each."""

    def __init__(self) -> None:
        self.buckets = {t: [0] * (len(ADAPTER_LOAD_BUCKETS) + 1) for t in TIERS}
        self.sums = dict.fromkeys(TIERS, 0.0)
        # adapter name -> [cold loads, of them from disk, summed seconds, the longest]
        self.cold: dict[str, list] = {}
        self.cold_loads = 0  # all adapters together: the top list is stale when it moved
        self._top: tuple[int, list[dict]] = (0, [])

    def record(self, name: str, tier: str, seconds: float) -> None:
        i = 0
        while i < len(ADAPTER_LOAD_BUCKETS) and seconds > ADAPTER_LOAD_BUCKETS[i]:
            i += 1
        self.buckets[tier][i] += 1
        self.sums[tier] += seconds
        if tier == "device":
            return
        c = self.cold.setdefault(name, [0, 0, 0.0, 0.0])
        c[0] += 1
        c[1] += tier == "disk"
        c[2] += seconds
        c[3] = max(c[3], seconds)
        self.cold_loads += 1

    def top(self) -> list[dict]:
        """The COLD_TOP adapters with the most cold loads (then the most load time), most first."""
        seen, top = self._top
        if seen != self.cold_loads:  # only after a cold load: snapshots come far more often
            seen = self.cold_loads
            rows = list(self.cold.items())  # one C-level copy: the engine may add meanwhile
            best = heapq.nlargest(COLD_TOP, rows, key=lambda kv: (kv[1][0], kv[1][2]))
            top = [
                {"adapter": name, "loads": c[0], "from_disk": c[1], "seconds": c[2],
                 "max_seconds": c[3]}
                for name, c in best
            ]  # fmt: skip
            self._top = (seen, top)
        return top
