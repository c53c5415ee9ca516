"""The dashboard's Guardrails page in a real browser: this month's counts per tenant and the
newest events, after a tenant's request was blocked."""

from __future__ import annotations

import secrets

import httpx
from playwright.sync_api import expect

from tests.utils.server import ADMIN_KEY


def test_the_guardrails_page_counts_and_lists_events(page, ui_server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    name = f"audited-{secrets.token_hex(3)}"
    tid, key = ui_server.new_tenant(name)
    r = httpx.post(f"{ui_server.url}/admin/api/tenants/{tid}/guardrails", headers=admin,
                   json={"name": "no-pecans", "stages": "input", "terms": ["pecan"]})  # fmt: skip
    assert r.status_code == 201, r.text
    r = httpx.post(
        f"{ui_server.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": ui_server.state.model_name, "prompt": "a pecan"},
        timeout=60,
    )
    assert r.json()["error"]["code"] == "content_filter"
    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    page.goto("/admin#guardrails")
    counts, events = page.locator("#guardrail-counts"), page.locator("#guardrail-events")
    expect(counts.locator("tr", has_text=name)).to_contain_text("1")
    expect(events.locator("tr", has_text="no-pecans")).to_contain_text(name)
    expect(events.locator("tr", has_text="no-pecans")).to_contain_text("block")
    assert page.watch.errors == [] and page.watch.foreign == []
