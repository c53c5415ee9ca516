"""The routing policies `loraplex bench fleet` compares: pick a replica for each request.

    round-robin     replicas in turn, blind to load and adapters
    least-queue     fewest requests in flight (waiting + running), ties at random
    affinity        the Inference Gateway endpoint picker's scoring (docs/fleet.md): per
                    replica, a LoRA-affinity score from what its /metrics shows
                    (`running_lora_adapters` = device slots, `waiting_lora_adapters`, `max_lora`)
                    plus a KV-usage score minus a queue penalty; the highest wins
    affinity-host   the same, and a replica also counts as holding an adapter that sits in its
                    host tier (EngineStats.host_adapters: no disk load, only a slot copy)

The affinity tiers follow the picker's LoRA-affinity scorer (1.0 adapter active, 0.8 adapter
waiting, 0.5 room for one more adapter, 0 otherwise; host tier 0.9 between active and
waiting). The queue term is absolute, not normalised across replicas: a replica that holds
the adapter keeps it until its queue is `queue_tolerance` requests longer than another's per
point of affinity, so a popular adapter spills over only under real imbalance.

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
ACTIVE, HOST, WAITING, ROOM = 1.0, 0.9, 0.8, 0.5  # the LoRA-affinity tiers


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
    """The picker's LoRA-affinity score of a replica for `adapter` (None: the base model)."""
    s = view.stats
    if adapter is None or adapter in s.resident_adapters or adapter in s.running_adapters:
        return ACTIVE
    if host_tier and adapter in s.host_adapters:
        return HOST
    if adapter in s.waiting_adapters or view.in_flight.get(adapter):
        return WAITING  # loading, or queued for a slot: it will be there
    if host_tier:
        return ROOM if s.adapters_in_host < view.max_cpu_loras else 0.0
    return ROOM if s.adapter_slots_used < s.adapter_slots else 0.0


class Router:
    def __init__(
        self,
        policy: str,
        num_replicas: int,
        *,
        seed: int = 0,
        queue_tolerance: float = 4.0,
        lora_weight: float = 1.0,
        kv_weight: float = 0.5,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; use one of {POLICIES}")
        if num_replicas < 1 or queue_tolerance <= 0:
            raise ValueError("need at least one replica and a positive queue_tolerance")
        self.policy, self.n = policy, num_replicas
        self.queue_tolerance, self.lora_weight, self.kv_weight = (
            queue_tolerance,
            lora_weight,
            kv_weight,
        )
        self._turn = itertools.cycle(range(num_replicas))
        self._rng = random.Random(f"router/{seed}")

    def score(self, view: ReplicaView, adapter: str | None) -> float:
        host_tier = self.policy == "affinity-host"
        return (
            self.lora_weight * lora_affinity(view, adapter, host_tier)
            + self.kv_weight * (1.0 - view.stats.kv_usage)
            - view.queue / self.queue_tolerance
        )

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
