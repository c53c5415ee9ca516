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


def test_a_policy_is_created_and_deleted_from_the_dashboard(page, ui_server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    name = f"shielded-{secrets.token_hex(3)}"
    tid, key = ui_server.new_tenant(name)
    url = f"{ui_server.url}/admin/api/tenants/{tid}/guardrails"
    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    page.goto("/admin#guardrails")
    form = page.locator("#create-policy")
    form.locator("select[name=tenant]").select_option(label=name)
    form.locator("input[name=name]").fill("no-walnuts")
    form.locator("select[name=stages]").select_option("input")
    form.locator("textarea[name=patterns]").fill("(")  # the server's refusal is shown, no policy
    form.locator("button[type=submit]").click()
    expect(page.locator("#flash")).to_contain_text("pattern")
    form.locator("textarea[name=patterns]").fill("")
    form.locator("textarea[name=terms]").fill("walnut\nhazelnut")
    form.locator("input[value=email]").check()
    form.locator("button[type=submit]").click()
    row = page.locator("#guardrail-policies tr", has_text="no-walnuts")
    expect(row).to_contain_text('"walnut", "hazelnut", email')
    (made,) = httpx.get(url, headers=admin).json()["data"]
    assert (made["stages"], made["action"], made["terms"], made["pii"]) == (
        "input", "block", ["walnut", "hazelnut"], ["email"],
    )  # fmt: skip
    r = httpx.post(
        f"{ui_server.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": ui_server.state.model_name, "prompt": "a Walnut", "max_tokens": 1},
        timeout=60,
    )
    assert r.json()["error"]["code"] == "content_filter"  # the policy is enforced at once

    row.locator("button", has_text="Delete").click()  # the fixture accepts the confirm()
    expect(page.locator("#guardrail-policies")).to_contain_text("This tenant has no policies.")
    assert httpx.get(url, headers=admin).json()["data"] == []
    # The one error is the refused pattern's 400, which the page showed.
    assert [e for e in page.watch.errors if "400 (Bad Request)" not in e] == []
    assert len(page.watch.errors) == 1 and page.watch.foreign == []


def test_a_policy_is_edited_from_the_dashboard(page, ui_server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    name = f"edited-{secrets.token_hex(3)}"
    tid, key = ui_server.new_tenant(name)
    url = f"{ui_server.url}/admin/api/tenants/{tid}/guardrails"
    r = httpx.post(url, headers=admin, json={"name": "no-figs", "stages": "input",
                                             "terms": ["fig"]})  # fmt: skip
    assert r.status_code == 201, r.text
    before = r.json()
    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    page.goto("/admin#guardrails")
    form = page.locator("#create-policy")
    form.locator("select[name=tenant]").select_option(label=name)
    row = page.locator("#guardrail-policies tr", has_text="no-figs")
    row.locator("button", has_text="Edit").click()
    expect(form.locator("input[name=name]")).to_have_value("no-figs")
    expect(form.locator("textarea[name=terms]")).to_have_value("fig")
    form.locator("textarea[name=patterns]").fill("(")  # refused whole: nothing changes
    form.locator("select[name=action]").select_option("flag")
    form.locator("button[type=submit]").click()
    expect(page.locator("#flash")).to_contain_text("pattern")
    assert httpx.get(url, headers=admin).json()["data"] == [before]
    form.locator("textarea[name=patterns]").fill("")
    form.locator("textarea[name=terms]").fill("date")
    form.locator("button", has_text="Save no-figs").click()
    expect(row).to_contain_text('"date"')
    expect(row).to_contain_text("flag")
    expect(form.locator("button[type=submit]")).to_have_text("Create policy")
    (after,) = httpx.get(url, headers=admin).json()["data"]
    assert (after["id"], after["action"], after["terms"]) == (before["id"], "flag", ["date"])
    auth = {"Authorization": f"Bearer {key}"}
    for prompt in ("a fig", "a date"):  # the edit applies at once: nothing blocked any more
        r = httpx.post(f"{ui_server.url}/v1/completions", headers=auth,
                       json={"model": ui_server.state.model_name, "prompt": prompt,
                             "max_tokens": 1}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    got = httpx.get(f"{ui_server.url}/admin/api/guardrails/events", headers=admin,
                    params={"tenant_id": tid}).json()["data"]  # fmt: skip
    assert [(e["action"], e["rule"]) for e in got] == [
        ("flag", "term"),
        ("policy_edit", "edit:action,terms"),
    ]
    assert [e for e in page.watch.errors if "400 (Bad Request)" not in e] == []
    assert page.watch.foreign == []
