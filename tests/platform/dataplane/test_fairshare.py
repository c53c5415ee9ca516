"""The in-flight window in front of a vLLM endpoint (platform/dataplane/fairshare.py): bounded,
filled in the tenants' virtual-token-counter order, interactive before batch, and never
leaking a place when a waiter is cancelled."""

from __future__ import annotations

import asyncio

from loraplex.platform.dataplane.agent import vllm_name
from loraplex.platform.dataplane.fairshare import FairWindow


def run(coro):
    return asyncio.run(coro)


async def _admit_order(window: FairWindow, arrivals: list[tuple[str, float, int]]) -> list[str]:
    """Requests arrive while the window is full; release one place at a time and return the
    order in which the queued ones are admitted."""
    held = [await window.admit("first", 1.0) for _ in range(window.size)]
    # The spare places go to tenants with nothing in flight: taken, so the arrivals queue.
    held += [await window.admit(f"idle{i}", 1.0) for i in range(window.spare)]
    order: list[str] = []

    async def one(tenant: str, cost: float, priority: int) -> None:
        admission = await window.admit(tenant, cost, priority=priority)
        order.append(tenant)
        held.append(admission)

    tasks = []
    for tenant, cost, priority in arrivals:
        tasks.append(asyncio.create_task(one(tenant, cost, priority)))
        await asyncio.sleep(0)
    assert window.running == window.size + window.spare and window.queued == len(arrivals)
    while len(order) < len(arrivals):
        held.pop(0).release(used=1.0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_a_light_tenant_passes_a_heavy_backlog():
    window = FairWindow(2)
    arrivals = [("heavy", 100.0, 0)] * 6 + [("light", 100.0, 0)]
    order = run(_admit_order(window, arrivals))
    assert order.index("light") <= 1, order  # not after the heavy backlog


def test_weights_and_costs_share_in_proportion():
    # Costs are already divided by weight: a tenant of weight 2 counts half per request.
    window = FairWindow(1)
    arrivals = [("a", 10.0, 0)] * 6 + [("b", 5.0, 0)] * 6
    order = run(_admit_order(window, arrivals))
    first_six = order[:6]
    assert first_six.count("b") >= 3, order  # b gets at least its even share early


def test_batch_waits_for_interactive():
    window = FairWindow(1)
    arrivals = [("batchy", 1.0, 1)] * 3 + [("live", 1000.0, 0)] * 2
    order = run(_admit_order(window, arrivals))
    assert order[:2] == ["live", "live"], order


def test_a_tenant_with_nothing_in_flight_goes_in_at_once():
    async def main() -> None:
        window = FairWindow(4)  # one spare place
        heavy = [await window.admit("heavy", 100.0) for _ in range(4)]
        queued = asyncio.create_task(window.admit("heavy", 100.0))
        await asyncio.sleep(0)
        light = await asyncio.wait_for(window.admit("light", 10.0), 1)  # no release needed
        assert window.running == 5 and not queued.done()
        # Its next request, while the first is in flight, waits its turn like any other.
        second = asyncio.create_task(window.admit("light", 10.0))
        await asyncio.sleep(0)
        assert not second.done()
        light.release(used=10.0)
        heavy[0].release(used=100.0)
        await asyncio.sleep(0)
        # VTC: the light tenant was lifted to the heavy one's counter and its first request
        # counted, so the heavy one's waiting request goes first, then the light one's.
        assert queued.done() and not second.done()
        heavy[1].release(used=100.0)
        await asyncio.sleep(0)
        assert second.done()
        for a in [*heavy[2:], second.result(), queued.result()]:
            a.release(used=1.0)
        assert window.running == 0

    run(main())


def test_cancelled_waiter_gives_its_place_on():
    async def main() -> None:
        window = FairWindow(1)
        first = await window.admit("a", 1.0)  # "a" in flight: its next requests queue
        waiting = asyncio.create_task(window.admit("a", 1.0))
        third = asyncio.create_task(window.admit("a", 1.0))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        first.release(used=1.0)
        admission = await asyncio.wait_for(third, 1)
        assert window.running == 1
        admission.release(used=1.0)
        assert window.running == 0 and window.queued == 0

    run(main())


def test_each_tenant_and_version_has_its_own_opaque_vllm_name():
    digest = "ab" * 32
    names = {vllm_name(f"{t}/m@v{v}", digest) for t in (1, 2) for v in (1, 2)}
    assert len(names) == 4
    assert all(n.startswith("lpx-") and "m@" not in n for n in names)
    assert vllm_name("1/m@v1", digest) == vllm_name("1/m@v1", digest)  # stable across replicas
