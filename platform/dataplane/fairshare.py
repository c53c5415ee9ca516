"""Fair share in front of a remote engine: a bounded in-flight window per endpoint, filled in
the tenants' virtual-token-counter order (VTC, Sheng et al. 2024).

vLLM schedules first come first served (or by a request's priority), so a tenant that sends
a thousand requests at once would hold every batch slot until they are done. Here at most
`size` requests per endpoint are in vLLM at once; the rest wait in the platform, and each
free place goes to the waiting request whose tenant has been served least, counted in tokens
divided by the tenant's weight. Interactive requests go before batch lines.

    counter[t] += (prompt + max new tokens) / weight[t]   when t's request is admitted
    counter[t] -= unused tokens / weight[t]              when it ends early
    a tenant that had nothing queued or running is lifted to the least counter of those that
    have (VTC's lift): idleness earns no credit to flood with later.

A window fills with requests that started together and, being alike, end together: a place
may not free for a whole request's time. So a few places beyond `size` (`spare`) go, at once,
to an interactive request of a tenant with nothing in flight on the endpoint: a light tenant
never waits for a heavy tenant's requests to end, and a heavy one, always in flight, never
gets them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    priority: int  # 0 interactive, 1 batch: interactive first
    counter: float  # the tenant's counter when it queued (re-read at each admission)
    seq: int
    tenant: str = field(compare=False)
    cost: float = field(compare=False)
    future: asyncio.Future = field(compare=False)


class FairWindow:
    """At most `size` admitted requests; `admit` waits for a place in VTC order."""

    def __init__(self, size: int) -> None:
        assert size >= 1
        self.size = size
        self.spare = max(1, size // 4)
        self.running = 0
        self._in: dict[str, int] = {}  # tenant -> requests admitted and not yet released
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> requests queued or running
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiting if not w.future.done())

    def _lift(self, tenant: str) -> None:
        if self._active.get(tenant):
            return
        busy = [self.counters[t] for t, n in self._active.items() if n and t in self.counters]
        floor = min(busy) if busy else 0.0
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    async def admit(self, tenant: str, cost: float, *, priority: int = 0) -> Admission:
        """Wait for a place; the caller must `release()` the admission when its request ends
        (however it ends)."""
        self._lift(tenant)
        self._active[tenant] = self._active.get(tenant, 0) + 1
        idle = not self._in.get(tenant) and priority == 0
        if (self.running < self.size and not self.queued) or (
            idle and self.running < self.size + self.spare
        ):
            return self._grant(tenant, cost)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, self.counters[tenant], next(self._seq), tenant, cost,
                         loop.create_future())  # fmt: skip
        heapq.heappush(self._waiting, waiter)
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted as it was cancelled: give the place and the charge back.
                self.running -= 1
                self._in[tenant] -= 1
                self.counters[tenant] -= cost
                self._wake()
            self._done(tenant)
            raise
        return Admission(self, tenant, cost)  # counted and charged when granted (_wake)

    def _grant(self, tenant: str, cost: float) -> Admission:
        self.running += 1
        self._in[tenant] = self._in.get(tenant, 0) + 1
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        return Admission(self, tenant, cost)

    def _done(self, tenant: str) -> None:
        self._active[tenant] -= 1
        if not self._active[tenant]:
            del self._active[tenant]

    def _wake(self) -> None:
        # Counters moved since the waiters queued: re-key them before picking.
        live = [w for w in self._waiting if not w.future.done()]
        for w in live:
            w.counter = self.counters.get(w.tenant, 0.0)
        heapq.heapify(live)
        self._waiting = live
        while self.running < self.size and self._waiting:
            w = heapq.heappop(self._waiting)
            if w.future.done():
                continue
            # Taken and charged on the waiter's behalf now, not when its task next runs:
            # places freed together (requests of one length end together) must see each
            # grant's charge, or one tenant's backlog takes them all.
            self.running += 1
            self._in[w.tenant] = self._in.get(w.tenant, 0) + 1
            self.counters[w.tenant] = self.counters.get(w.tenant, 0.0) + w.cost
            w.future.set_result(None)

    def release(self, admission: Admission, used: float) -> None:
        refund = max(0.0, admission.cost - used)
        self.counters[admission.tenant] -= refund
        self.running -= 1
        self._in[admission.tenant] -= 1
        self._done(admission.tenant)
        self._wake()


@dataclass
class Admission:
    window: FairWindow
    tenant: str
    cost: float
    released: bool = False

    def release(self, used: float) -> None:
        if not self.released:
            self.released = True
            self.window.release(self, used)
