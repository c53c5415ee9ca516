"""The admin overview's latency section in a real browser: p50/p99 TTFT and TPOT over time
from the ledger, for all tenants or one, and the tenant whose p99 TTFT rose, flagged."""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from loraplex.platform import replicas as heartbeat
from loraplex.platform.db import crud
from loraplex.platform.db.models import utcnow
from loraplex.platform.usage import record_usage
from tests.admin_ui.conftest import DESKTOP, PHONE
from tests.utils.server import ADMIN_KEY, upload_adapter


@pytest.fixture
def shots() -> Path:
    out = Path(os.environ.get("LORAPLEX_ARTIFACTS", "/tmp/artifacts")) / "overview"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def _shoot(page, shots: Path, name: str) -> None:
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(300)  # the charts redraw at the new width
        wide = page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
        culprits = page.evaluate(
            """() => [...document.querySelectorAll("body *")]
              .filter((e) => e.getBoundingClientRect().right > window.innerWidth + 1)
              .slice(0, 5).map((e) => `${e.tagName}#${e.id}.${e.getAttribute("class")}`)"""
        )
        assert wide <= 0, f"{name} at {label} width is {wide}px too wide: {culprits}"
        page.screenshot(path=shots / f"{name}-{label}.png", full_page=True)
    page.set_viewport_size(DESKTOP)
    docs = os.environ.get("LORAPLEX_SCREENSHOTS_DIR")
    if docs:
        for label in ("desktop", "phone"):
            shutil.copy(shots / f"{name}-{label}.png", Path(docs) / f"{name}-{label}.png")


def test_latency_overview(page, ui_server, shots):
    now = utcnow()
    with ui_server.sessions() as session:
        slow = crud.create_tenant(session, name="slowpoke")
        steady = crud.create_tenant(session, name="steady")
        n = 0
        # The hour before: both at 100 ms TTFT. The last hour: slowpoke's p99 rises to 900 ms.
        for minutes_ago in range(5, 115, 5):
            at = now - timedelta(minutes=minutes_ago)
            recent = minutes_ago < 60
            for tenant, ttft in ((slow, 900.0 if recent and minutes_ago % 10 == 0 else 100.0),
                                 (steady, 100.0 + minutes_ago % 3)):  # fmt: skip
                n += 1
                record_usage(session, request_id=f"lat-{n}", tenant_id=tenant.id, model="m",
                             adapter_name="bot" if tenant is slow else None, prompt_tokens=5,
                             completion_tokens=9, status="error" if n % 7 == 0 else "ok",
                             latency_ms=2000, ttft_ms=ttft, tpot_ms=20.0 + minutes_ago % 4,
                             created_at=at)  # fmt: skip

    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=overview] h1")).to_have_text("Overview")

    expect(page.locator("#t-adapters .sub")).to_contain_text("loads")
    ttft = page.locator("#chart-ttft")
    expect(ttft).to_contain_text("Time to first token · all tenants")
    expect(ttft.locator("svg path.line")).to_have_count(2)  # p50 and p99
    # A value axis with round ticks up to the highest p99, and a time axis.
    ticks = ttft.locator("svg text.tick").all_text_contents()
    assert "0 ms" in ticks and any(t.endswith("ms") and t != "0 ms" for t in ticks), ticks
    assert any(":" in t for t in ticks), ticks  # HH:MM on a 1-hour window
    # Hovering shows the values of the nearest bucket.
    ttft.scroll_into_view_if_needed()  # below the live engine section
    box = ttft.locator("svg rect.hit").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] / 2)
    tip = ttft.locator(".tip")
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("p99:")
    expect(tip).to_contain_text("requests")

    row = page.locator("#lat-tenants tr", has_text="slowpoke")
    expect(row.locator("td[data-label='p99 TTFT']")).to_contain_text("9")  # ~900 ms
    expect(row.locator("td[data-label='p99 TTFT before']")).to_have_text("100 ms")
    expect(row.locator(".rose")).to_contain_text("▲")
    steady_row = page.locator("#lat-tenants tr", has_text="steady")
    expect(steady_row.locator(".rose")).to_have_count(0)
    _shoot(page, shots, "overview-latency")

    # One tenant, then its adapter: the chart says whose it is and draws only theirs.
    row.get_by_role("button", name="slowpoke").click()
    expect(ttft).to_contain_text("Time to first token · slowpoke")
    page.select_option("#lat-adapter", "bot")
    expect(page.locator("#chart-ttft")).to_contain_text("slowpoke / bot")
    page.select_option("#lat-tenant", str(steady.id))
    expect(page.locator("#lat-adapter")).to_have_value("*")  # steady has no adapter "bot"
    page.select_option("#lat-adapter", "")
    expect(page.locator("#chart-tpot")).to_contain_text("steady / (base model)")
    expect(page.locator("#chart-tpot svg path.line")).to_have_count(2)
    page.select_option("#lat-window", "7d")
    expect(page.locator("#lat-tenants h2")).to_have_text("By tenant, last 7d")

    assert page.watch.errors == []
    assert page.watch.foreign == []


def test_replicas_and_cold_loads(page, ui_server, tiny_adapters, shots):
    """The live engine section: this replica's state (read from its engine, first; its peers'
    come from their heartbeat rows) and the adapter that cold-loaded, with its load time."""
    _, key = ui_server.new_tenant("coldco")
    uploaded = upload_adapter(ui_server.url, key, "qv", tiny_adapters["llama"]["qv4"])
    assert uploaded.status_code == 201
    for _ in range(2):  # read from disk, then found in its slot
        r = httpx.post(f"{ui_server.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": "qv", "prompt": "hi", "max_tokens": 1})  # fmt: skip
        assert r.status_code == 200, r.text
    for path in ("/admin/api/replicas", "/admin/api/adapter-loads"):  # the admin's only
        refused = httpx.get(ui_server.url + path, headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code in (401, 403), (path, refused.status_code)

    gone = utcnow() - timedelta(minutes=1)  # a peer that stopped beating (default 5 s)
    with ui_server.sessions() as session:
        heartbeat.beat(session, "peer:8000:1", {"alive": True}, started_at=gone, now=gone)

    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    replicas = page.locator("#replicas")
    engines = replicas.locator("td[data-label=Engine]")
    expect(engines).to_have_text(["running", "stale"])  # this page's replica first
    expect(replicas.locator("td[data-label='In slots']").first).to_contain_text("coldco / qv")
    expect(replicas.locator("td[data-label=Replica]").first).to_contain_text("(this page's)")
    expect(replicas).to_contain_text("1 replica(s) missed 3 heartbeats")
    expect(replicas).not_to_contain_text("heartbeat is off")  # on by default: a fleet's list
    loads = page.locator("#cold-loads")
    row = loads.locator("tr", has_text="coldco")
    expect(row.locator("td[data-label=Adapter]")).to_contain_text("qv")
    expect(row.locator("td[data-label='From disk']")).to_have_text("1")
    expect(row.locator("td[data-label='Mean load']")).to_contain_text("ms")
    expect(loads).to_contain_text("1 in a slot")
    expect(loads).to_contain_text("1 read from disk")
    _shoot(page, shots, "overview-engine")
    with ui_server.sessions() as session:
        heartbeat.remove(session, "peer:8000:1")
    assert page.watch.errors == []
    assert page.watch.foreign == []
