"""Run operations in threads under a schedule that a property test draws.

Races between requests live in the moments between a registry transaction and a store call.
Threads left to the OS scheduler hit such a window now and then (the lost-adapter race: 12 in
81 tries against a live server); a test that chooses who goes next at each of those moments
explores them on purpose, and hypothesis shrinks a failing schedule to the few switches that
matter.

Wrap the shared resource (`GatedStore`) so every call passes `gate()` before and after; each
managed thread then stops at a gate until the schedule picks it. A thread that does not reach
a gate in time (blocked on a database lock another paused thread holds, say) is counted as
running, so a schedule can slow a run down but never deadlock it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

_STALL_S = 2.0  # a thread this long between gates is blocked elsewhere: stop waiting for it


class Interleaver:
    def __init__(self, schedule: Sequence[int]):
        self.schedule = list(schedule)
        self._cv = threading.Condition()
        self._local = threading.local()
        self._at_gate: dict[int, str] = {}  # thread index -> gate it waits at
        self._go: set[int] = set()
        self._done: set[int] = set()
        self.trace: list[tuple[int, str]] = []  # (thread, gate) in the order they passed

    def gate(self, where: str) -> None:
        me = getattr(self._local, "index", None)
        if me is None:  # not a managed thread (setup, invariant checks): never stops
            return
        with self._cv:
            self._at_gate[me] = where
            self._cv.notify_all()
            while me not in self._go:
                self._cv.wait()
            self._go.discard(me)
            del self._at_gate[me]
            self.trace.append((me, where))

    def run(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run each op in its own thread under the schedule; returns results (or exceptions)."""
        results: list[Any] = [None] * len(ops)

        def body(i: int) -> None:
            self._local.index = i
            try:
                results[i] = ops[i]()
            except Exception as e:  # the caller judges errors as outcomes
                results[i] = e
            finally:
                with self._cv:
                    self._done.add(i)
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(ops))]
        for t in threads:
            t.start()
        with self._cv:
            while len(self._done) < len(ops):
                # Wait until every live thread is at a gate or finished (or stalled elsewhere).
                self._cv.wait_for(
                    lambda: len(self._at_gate) + len(self._done) == len(ops), timeout=_STALL_S
                )
                waiting = sorted(i for i in self._at_gate if i not in self._go)
                if not waiting:
                    continue
                pick = self.schedule.pop(0) if self.schedule else 0
                self._go.add(waiting[pick % len(waiting)])
                self._cv.notify_all()
                # Let the picked thread leave its gate before deciding again.
                self._cv.wait_for(lambda: not self._go, timeout=_STALL_S)
        for t in threads:
            t.join(30)
        return results


class GatedStore:
    """An adapter store whose every call is a scheduling point, before and after."""

    def __init__(self, store, interleaver: Callable[[], Interleaver | None]):
        self._store, self._interleaver = store, interleaver

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def gated(*args, **kwargs):
            il = self._interleaver()
            if il is not None:
                il.gate(f"before {name}")
            try:
                return attr(*args, **kwargs)
            finally:
                if il is not None:
                    il.gate(f"after {name}")

        return gated
