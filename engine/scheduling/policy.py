"""Scheduling policies: which waiting request is admitted next, which running one yields.

The scheduler asks the policy and never decides order itself. Two policies:

- `FCFSPolicy`: arrival order; the latest arrival is preempted first.
- `VTCPolicy`: the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
  Models" (OSDI 2024), weighted. Each tenant has a counter of the service it received divided
  by its weight: prompt tokens are charged when a request is admitted, output tokens as they
  are produced. Admission always goes to the tenant with the smallest counter, so between two
  backlogged tenants the counters (and so the weighted service) differ by a bounded amount.
  On a KV shortage the tenant with the largest counter yields its request that is cheapest
  to recompute (fewest computed tokens).

A tenant returning from idle starts at the smallest counter of the active tenants: it cannot
bank credit while away, nor is it punished for past use. Admission stays work-conserving: a
tenant that cannot be admitted (adapter still loading, no adapter slot) is skipped, not
waited for. The one exception keeps adapters from starving: when a tenant is skipped for want
of an adapter slot, others may pass it only while they lead it by less than `slot_slack`;
then admission stops, running requests drain, and a slot frees up for it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.scheduling.admission import cheapest_victim
from loraplex.engine.sequence import Sequence

if TYPE_CHECKING:
    from loraplex.engine.config import EngineConfig


class SchedulingPolicy(Protocol):
    def on_arrival(self, seq: Sequence) -> None:
        """A new request was queued (not called again when a preempted one re-queues)."""
        ...

    def admission_order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """Waiting sequences in the order they should be considered for admission.

        Lazy: the order may depend on what was admitted (and charged) so far this step, and
        the iterator may stop early. It must not rely on `waiting` staying unchanged.
        """
        ...

    def on_admitted(self, seq: Sequence) -> None: ...

    def on_forked(self, seq: Sequence) -> None:
        """`seq` is another sample of an admitted request (n > 1): its prompt is shared."""
        ...

    def on_blocked(self, seq: Sequence) -> None:
        """`seq` was skipped because every adapter slot is taken by other adapters."""
        ...

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None: ...

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when KV blocks run out."""
        ...

    def on_finished(self, seq: Sequence) -> None:
        """`seq` left the scheduler (finished or aborted), wherever it was."""
        ...


class FCFSPolicy:
    """First come, first served; the latest arrival is preempted first, or with
    `least_recompute` the request cheapest to recompute (fewest computed tokens) other than
    the oldest, which always keeps its blocks so the queue drains."""

    def __init__(self, least_recompute: bool = False):
        self.least_recompute = least_recompute

    def on_arrival(self, seq: Sequence) -> None:
        pass

    def admission_order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        return iter(sorted(waiting, key=lambda s: (s.arrival, s.seq_no)))

    def on_admitted(self, seq: Sequence) -> None:
        pass

    def on_forked(self, seq: Sequence) -> None:
        pass

    def on_blocked(self, seq: Sequence) -> None:
        pass

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        if self.least_recompute and len(running) > 1:
            oldest = min(running, key=lambda s: (s.arrival, s.seq_no))
            return cheapest_victim([s for s in running if s is not oldest])
        return max(running, key=lambda s: (s.arrival, s.seq_no))

    def on_finished(self, seq: Sequence) -> None:
        pass


def _tenant(seq: Sequence) -> str:
    return seq.tenant or ""  # requests without a tenant share one


class VTCPolicy:
    """Weighted Virtual Token Counter fair share (see the module docstring)."""

    def __init__(self, slot_slack: float):
        self.slot_slack = slot_slack
        self.counters: dict[str, float] = {}  # tenant -> service / weight
        self.weights: dict[str, float] = {}
        self.active: dict[str, int] = {}  # tenant -> requests waiting or running
        self._charged: set[int] = set()  # seq_no of requests whose prompt is charged
        self._blocked_floor = math.inf  # lowest counter skipped for a slot this step

    def _weight(self, seq: Sequence) -> float:
        return self.weights.get(_tenant(seq), 1.0)

    def on_arrival(self, seq: Sequence) -> None:
        t = _tenant(seq)
        self.weights[t] = seq.weight
        if not self.active.get(t):
            others = [self.counters[u] for u, n in self.active.items() if n and u != t]
            # Nobody active: everyone returning starts level, at the highest counter.
            floor = min(others) if others else max(self.counters.values(), default=0.0)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self.active[t] = self.active.get(t, 0) + 1

    def admission_order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        queues: dict[str, deque[Sequence]] = {}
        for seq in sorted(waiting, key=lambda s: (s.arrival, s.seq_no)):
            queues.setdefault(_tenant(seq), deque()).append(seq)
        self._blocked_floor = math.inf
        while queues:
            t = min(queues, key=lambda u: (self.counters[u], queues[u][0].arrival))
            if self.counters[t] - self._blocked_floor >= self.slot_slack:
                return  # let running requests drain so the skipped tenant gets a slot
            seq = queues[t].popleft()
            if not queues[t]:
                del queues[t]
            yield seq

    def on_admitted(self, seq: Sequence) -> None:
        # A preempted request is re-admitted free: recomputing it was our choice, not theirs.
        if seq.seq_no not in self._charged:
            self._charged.add(seq.seq_no)
            self.counters[_tenant(seq)] += seq.num_prompt_tokens / self._weight(seq)

    def on_forked(self, seq: Sequence) -> None:
        self.on_arrival(seq)
        self._charged.add(seq.seq_no)  # the prompt was charged once, to the first sample

    def on_blocked(self, seq: Sequence) -> None:
        self._blocked_floor = min(self._blocked_floor, self.counters[_tenant(seq)])

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        self.counters[_tenant(seq)] += num_tokens / self._weight(seq)

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        # The tenant that received the most service gives memory back (a light tenant never
        # pays for a heavy one), with the request of its whose recompute costs least.
        most = max(self.counters[_tenant(s)] for s in running)
        return cheapest_victim([s for s in running if self.counters[_tenant(s)] == most])

    def on_finished(self, seq: Sequence) -> None:
        t = _tenant(seq)
        self._charged.discard(seq.seq_no)
        self.active[t] -= 1
        if not self.active[t]:
            del self.active[t]


def make_policy(name: str, config: EngineConfig | None = None) -> SchedulingPolicy:
    if name == "fcfs":
        # With KV-aware admission, preemption is rare and picks the cheapest recompute.
        return FCFSPolicy(least_recompute=config is not None and config.kv_admission)
    if name == "vtc":
        # One step's token budget: about the service a single admission decision can shift.
        slack = config.max_num_batched_tokens if config is not None else 2048
        return VTCPolicy(slot_slack=float(slack))
    raise ValueError(f"unknown scheduling policy {name!r}; use 'fcfs' or 'vtc'")
