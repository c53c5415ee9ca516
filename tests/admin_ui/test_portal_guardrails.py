"""The portal's Guardrails page in a real browser: the tenant's policies and the event its
blocked request left, and nothing of another tenant's."""

from __future__ import annotations

import secrets

import httpx
from playwright.sync_api import expect

from tests.utils.server import ADMIN_KEY


def test_the_guardrails_page_lists_own_policies_and_events(page, ui_server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tid, key = ui_server.new_tenant(f"guarded-{secrets.token_hex(3)}")
    other, _ = ui_server.new_tenant(f"other-{secrets.token_hex(3)}")
    for t, name in ((tid, "no-walnuts"), (other, "their-policy")):
        r = httpx.post(f"{ui_server.url}/admin/api/tenants/{t}/guardrails", headers=admin,
                       json={"name": name, "stages": "input", "terms": ["walnut"]})  # fmt: skip
        assert r.status_code == 201, r.text
    r = httpx.post(
        f"{ui_server.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": ui_server.state.model_name, "prompt": "a walnut"},
        timeout=60,
    )
    assert r.json()["error"]["code"] == "content_filter"
    page.goto("/portal")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=account]")).to_be_visible()
    page.click("#nav a[href='#guardrails']")
    policies, events = page.locator("#policies"), page.locator("#events")
    expect(policies).to_contain_text("no-walnuts")
    expect(policies).to_contain_text("1 terms")
    expect(policies).not_to_contain_text("their-policy")
    expect(events).to_contain_text("no-walnuts")
    expect(events).to_contain_text("block")
    assert page.watch.errors == [] and page.watch.foreign == []
