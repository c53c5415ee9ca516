"""A running engine read into an `EngineStats` snapshot (`engine_stats`) and the cheap key a
router compares to know when a new snapshot is due (`routing_key`). Apart from `stats.py`,
which only defines what a snapshot holds, so that the plain types never import the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.engine.stats import EngineStats

if TYPE_CHECKING:
    from loraplex.engine.llm_engine import LLMEngine


def _names(ids, names: dict[int, str]) -> list[str]:
    return [names[i] for i in ids if i in names]


def routing_key(engine: LLMEngine) -> tuple:
    """What a router reads of a snapshot, cheaply: request counts and adapter residency
    (a new snapshot is due when it changes; `engine_stats` costs more, every step)."""
    sched, ad = engine.scheduler, engine.adapters
    waiting_adapters = tuple(s.adapter_id for s in sched.waiting)
    return (
        len(sched.running),
        len(sched.paused),
        waiting_adapters,
        tuple(ad.slots),
        len(ad.host),
        len(ad.loading),
    )


def engine_stats(engine: LLMEngine, alive: bool) -> EngineStats:
    """A snapshot of `engine` (read without locking: may be one step stale)."""
    bm, ad, sched = engine.block_manager, engine.adapters, engine.scheduler
    c = ad.counters
    # Names of every adapter the engine knows now: from its requests, then host memory.
    names = {a_id: a.name for a_id, a in list(ad.host.items())}
    running = list(sched.running)
    waiting = list(sched.waiting)
    for seq in running + waiting:
        if seq.lora is not None:
            names[seq.lora.lora_int_id] = seq.lora.lora_name
    slots = [s for s in list(ad.slots) if s is not None]
    running_ids = dict.fromkeys(s.adapter_id for s in running if s.adapter_id)
    waiting_ids = dict.fromkeys(
        s.adapter_id for s in waiting if s.adapter_id and s.adapter_id not in slots
    )
    spec = engine.spec_stats
    loads = engine.adapter_loads
    tiers = engine.kv_tiers
    counters = dict(tiers.counters) if tiers is not None else {}
    return EngineStats(
        running=len(running),
        waiting=len(waiting),
        paused=len({s.request_id for s in list(sched.paused)}),
        steps=engine.num_steps,
        generated_tokens=engine.num_generated_tokens,
        kv_usage=bm.usage,
        kv_blocks=bm.num_blocks,
        kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
        block_size=engine.config.block_size,
        preemptions=sched.num_preemptions,
        swapped_out=sched.swap.num_swapped_out if sched.swap else 0,
        swapped_in=sched.swap.num_swapped_in if sched.swap else 0,
        prefix_queries=bm.prefix_queries,
        prefix_hits=bm.prefix_hits,
        adapter_hits=c.hits,
        adapter_loads=c.loads,
        adapters_in_host=len(ad.host),
        adapter_slots_used=len(slots),
        adapter_slots=len(ad.slots),
        alive=alive,
        adapter_misses=c.misses,
        adapter_load_failures=c.load_failures,
        adapter_load_seconds=c.load_seconds,
        adapters_loading=len(ad.loading),
        adapter_slot_writes=c.slot_writes,
        adapter_slot_bytes=engine.memory.adapter_slot_bytes,
        kv_cache_bytes=engine.memory.kv_cache_bytes,
        resident_adapters=_names(slots, names),
        host_adapters=_names(list(ad.host), names),
        running_adapters=_names(running_ids, names),
        waiting_adapters=_names(waiting_ids, names),
        spec_drafts=spec.num_drafts,
        spec_draft_tokens=spec.num_draft_tokens,
        spec_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
        adapter_load_buckets={t: list(b) for t, b in loads.buckets.items()},
        adapter_load_sum=dict(loads.sums),
        cold_adapters=[dict(row) for row in loads.top()],
        kv_tier_queried={t: c.queried for t, c in counters.items()},
        kv_tier_hits={t: c.hits for t, c in counters.items()},
        kv_tier_bytes_read={t: c.bytes_read for t, c in counters.items()},
        kv_tier_bytes_written={t: c.bytes_written for t, c in counters.items()},
        kv_tier_bytes_stored=tiers.stored_bytes() if tiers is not None else {},
        kv_tier_tokens_loaded=tiers.tokens_loaded if tiers is not None else 0,
    )
