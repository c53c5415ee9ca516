"""The routing policies `python -m benchmarks.fleet` compares: pick a replica for each request.

    round-robin     replicas in turn, blind to load and adapters
    least-queue     fewest requests in flight (waiting + running), ties at random
    affinity        the Inference Gateway endpoint picker's scoring (docs/fleet.md): per
                    replica, a LoRA-affinity score from what its /metrics shows
                    (`running_lora_adapters` = device slots, `waiting_lora_adapters`, `max_lora`)
                    plus a KV-usage score minus a queue penalty; the highest wins
    affinity-host   the same slot tiers (a slot is free unless a running request uses it),
                    plus `host_weight` where the adapter sits in the replica's host tier
                    (EngineStats.host_adapters: no disk read, only a slot copy)

The affinity tiers follow the picker's LoRA-affinity scorer (1.0 adapter active, 0.8 adapter
waiting, 0.5 room for one more adapter, 0 otherwise). The queue term is absolute, not
normalised across replicas: each request queued costs 1 / `queue_tolerance` points, so a
replica holding the adapter keeps it until its queue is that much longer than another's.

A replica's queue is the router's own count of requests it sent there that have not finished:
the replica's waiting + running without a scrape's lag (requests routed in one burst would
otherwise all see the same stale snapshot and pile onto one replica).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from loraplex.engine.stats import EngineStats

POLICIES = ("round-robin", "least-queue", "affinity", "affinity-host")
ACTIVE, WAITING, ROOM = 1.0, 0.8, 0.5  # the LoRA-affinity tiers


@dataclass
class ReplicaView:
    """What the router knows of one replica when it routes a request."""

    stats: EngineStats
    max_cpu_loras: int
    in_flight: dict[str, int] = field(default_factory=dict)  # adapter -> requests not finished

    @property
    def queue(self) -> int:
        return sum(self.in_flight.values())


def lora_affinity(view: ReplicaView, adapter: str | None, host_tier: bool) -> float:
    """The picker's LoRA-affinity score of a replica for `adapter` (None: the base model).

    Without the host tier a slot counts as taken once an adapter sits in it (all /metrics
    shows); with it, only while a running request uses it (an idle slot is reused at once).
    """
    s = view.stats
    if adapter is None or adapter in s.resident_adapters or adapter in s.running_adapters:
        return ACTIVE
    if adapter in s.waiting_adapters or view.in_flight.get(adapter):
        return WAITING  # loading, or queued for a slot: it will be there
    taken = len(s.running_adapters) if host_tier else s.adapter_slots_used
    return ROOM if taken < s.adapter_slots else 0.0


def host_affinity(view: ReplicaView, adapter: str | None) -> float:
    """1 where the adapter's weights are in the replica's host tier (or on their way there):
    a request sent elsewhere reads them from disk."""
    s = view.stats
    if adapter is None:
        return 0.0
    held = adapter in s.host_adapters or adapter in s.waiting_adapters
    return 1.0 if held or view.in_flight.get(adapter) else 0.0


class Router:
    def __init__(
        self,
        policy: str,
        num_replicas: int,
        *,
        seed: int = 0,
        queue_tolerance: float = 2.0,
        lora_weight: float = 1.0,
        kv_weight: float = 0.5,
        host_weight: float = 1.0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; use one of {POLICIES}")
        if num_replicas < 1 or queue_tolerance <= 0:
            raise ValueError("need at least one replica and a positive queue_tolerance")
        self.policy, self.n = policy, num_replicas
        self.queue_tolerance, self.lora_weight = queue_tolerance, lora_weight
        self.kv_weight, self.host_weight = kv_weight, host_weight
        self._turn = itertools.cycle(range(num_replicas))
        self._rng = random.Random(f"router/{seed}")

    def score(self, view: ReplicaView, adapter: str | None) -> float:
        host_tier = self.policy == "affinity-host"
        score = (
            self.lora_weight * lora_affinity(view, adapter, host_tier)
            + self.kv_weight * (1.0 - view.stats.kv_usage)
            - view.queue / self.queue_tolerance
        )
        return score + (self.host_weight * host_affinity(view, adapter) if host_tier else 0.0)

    def pick(self, views: list[ReplicaView], adapter: str | None) -> int:
        """The replica index for a request naming `adapter`."""
        assert len(views) == self.n
        if self.policy == "round-robin":
            return next(self._turn)
        if self.policy == "least-queue":
            keys = [v.queue for v in views]
            best = min(keys)
        else:
            keys = [-round(self.score(v, adapter), 9) for v in views]
            best = min(keys)
        return self._rng.choice([i for i, k in enumerate(keys) if k == best])
