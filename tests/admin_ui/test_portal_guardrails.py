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


def test_the_tenant_switches_recorded_text_on_and_off(page, ui_server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tid, key = ui_server.new_tenant(f"switch-{secrets.token_hex(3)}")
    made = []
    for name in ("watch", "gone"):
        r = httpx.post(f"{ui_server.url}/admin/api/tenants/{tid}/guardrails", headers=admin,
                       json={"name": name, "stages": "input", "action": "flag",
                             "terms": ["walnut"]})  # fmt: skip
        assert r.status_code == 201, r.text
        made.append(r.json())
    watch, gone = made

    def ask() -> dict:
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{ui_server.url}/v1/completions", headers=auth,
                       json={"model": ui_server.state.model_name, "prompt": "a walnut",
                             "max_tokens": 1}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        events = httpx.get(f"{ui_server.url}/v1/guardrails/events",
                           headers=auth).json()["data"]  # fmt: skip
        return next(e for e in events if e["request_id"] == r.json()["id"]
                    and e["policy_id"] == watch["id"])  # fmt: skip

    page.goto("/portal")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=account]")).to_be_visible()
    page.click("#nav a[href='#guardrails']")
    switch = page.locator(f"#record-text-{watch['id']}")
    expect(switch).not_to_be_checked()  # off unless the tenant says so
    switch.check()
    expect(page.locator("#flash")).to_contain_text("now keep the text")
    assert ask()["text"] == "walnut"
    page.reload()  # the switch shows what is stored
    expect(page.locator(f"#record-text-{watch['id']}")).to_be_checked()
    expect(page.locator("#events")).to_contain_text("policy_edit")  # the opt-in is audited
    page.locator(f"#record-text-{watch['id']}").uncheck()
    expect(page.locator("#flash")).to_contain_text("keep no text")
    assert ask()["text"] is None
    # A policy the operator deleted meanwhile: the server's 404 is shown, the switch stays off.
    r = httpx.delete(f"{ui_server.url}/admin/api/tenants/{tid}/guardrails/{gone['id']}",
                     headers=admin)  # fmt: skip
    assert r.status_code == 204
    stale = page.locator(f"#record-text-{gone['id']}")
    stale.click()
    expect(page.locator("#flash")).to_contain_text(f"no guardrail policy {gone['id']}")
    expect(stale).not_to_be_checked()
    expect(stale).to_be_enabled()
    assert [e for e in page.watch.errors if "404" not in e] == [] and page.watch.foreign == []
