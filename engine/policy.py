"""Scheduling policies: which waiting request is admitted next, which running one yields.

The scheduler asks the policy and never decides order itself, so fair share (a later policy)
replaces this file's FCFS without touching the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from loraplex.engine.sequence import Sequence


class SchedulingPolicy(Protocol):
    def admission_order(self, waiting: list[Sequence]) -> Iterable[Sequence]:
        """Waiting sequences in the order they should be considered for admission."""
        ...

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when KV blocks run out."""
        ...

    def on_admitted(self, seq: Sequence) -> None: ...

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None: ...


class FCFSPolicy:
    """First come, first served; the latest arrival is preempted first."""

    def admission_order(self, waiting: list[Sequence]) -> Iterable[Sequence]:
        return sorted(waiting, key=lambda s: (s.arrival, s.seq_no))

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=lambda s: (s.arrival, s.seq_no))

    def on_admitted(self, seq: Sequence) -> None:
        pass

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass


def make_policy(name: str) -> SchedulingPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}")
