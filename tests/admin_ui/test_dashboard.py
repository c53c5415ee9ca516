"""The operator's whole flow in a real browser, from sign-in to the billing CSV.

Sign in, create a tenant, set its quotas, create a key (copy its secret), upload an adapter
and make a completion with that key as a tenant would, see both in the dashboard, download
the billing CSV, then suspend the tenant, revoke the key, delete the adapter and sign out.
Every page is photographed at desktop and phone width along the way.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
from pathlib import Path

import httpx
import openai
from playwright.sync_api import expect

from tests.admin_ui.conftest import DESKTOP, PHONE
from tests.admin_ui.rows import named_row
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import folder_parts, upload

PAGES = ("overview", "tenants", "keys", "adapters", "usage")


def _shoot(page, artifacts: Path, name: str) -> None:
    """Full-page screenshots at desktop and phone width (and into docs/ when asked)."""
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(150)  # one frame for the layout to settle at the new width
        page.screenshot(path=artifacts / f"{name}-{label}.png", full_page=True)
    page.set_viewport_size(DESKTOP)
    docs = os.environ.get("LORAPLEX_SCREENSHOTS_DIR")
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
        for label in ("desktop", "phone"):
            shutil.copy(artifacts / f"{name}-{label}.png", Path(docs) / f"{name}-{label}.png")


def _go(page, name: str) -> None:
    page.goto(f"/admin#{name}")
    expect(page.locator(f"main[data-page={name}] h1")).to_be_visible()


def _admin_get(server, path: str) -> dict:
    r = httpx.get(f"{server.url}/admin/api{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_operator_flow(page, ui_server, tiny_adapters, artifacts):
    # --- sign in (a wrong key first) -----------------------------------------------------
    page.goto("/admin")
    expect(page).to_have_url(f"{ui_server.url}/admin/login")
    _shoot(page, artifacts, "signin")
    page.fill("#admin_key", ADMIN_KEY + "-wrong")
    page.click("button[type=submit]")
    expect(page.locator("#error")).to_be_visible()
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=overview] h1")).to_have_text("Overview")
    cookie = next(c for c in page.context.cookies() if c["name"] == "lpx_admin")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    # --- tenant: create, then weight, price and a quota ------------------------------------
    _go(page, "tenants")
    form = page.locator("#create-tenant")
    form.locator("input[name=name]").fill("acme")
    form.locator("input[name=price_prompt_per_1k]").fill("0.5")
    form.locator("input[name=price_completion_per_1k]").fill("2")
    form.locator("button[type=submit]").click()
    row = page.locator("tr", has_text="acme")
    expect(row).to_contain_text("active")
    row.get_by_role("button", name="Edit").click()
    editor = page.locator("#edit-tenant")
    editor.locator("input[name=weight]").fill("3")
    editor.locator("input[name=requests_per_min]").fill("120")
    editor.locator("button[type=submit]").click()
    expect(page.locator("tr", has_text="acme").locator("td").nth(2)).to_have_text("3")
    tenant_id = _admin_get(ui_server, "/tenants")["data"][0]["id"]
    assert _admin_get(ui_server, f"/tenants/{tenant_id}/quota")["requests_per_min"] == 120

    # --- key: create, copy the secret shown once -------------------------------------------
    page.locator("tr", has_text="acme").get_by_role("link", name="Keys").click()
    page.locator("#create-key input[name=name]").fill("web")
    page.locator("#create-key button[type=submit]").click()
    secret = page.locator("#new-secret").input_value()
    assert secret.startswith("lpx_")
    page.click("#copy-secret")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    _shoot(page, artifacts, "keys-secret")

    # --- as the tenant: upload an adapter and make a completion with the new key -----------
    up = upload(ui_server.url, secret, "support-bot", folder_parts(tiny_adapters["llama"]["qv4"]))
    assert up.status_code == 201, up.text
    client = openai.OpenAI(base_url=f"{ui_server.url}/v1", api_key=secret, max_retries=0)
    done = client.completions.create(
        model="support-bot", prompt="Hello there", max_tokens=5, temperature=0
    )
    tokens = done.usage.prompt_tokens + done.usage.completion_tokens

    # --- the dashboard shows them ----------------------------------------------------------
    _go(page, "adapters")
    row = page.locator("tr", has_text="support-bot")
    expect(row).to_contain_text("acme")
    expect(row).to_contain_text("ready")
    expect(row.locator("td[data-label=Rank]")).to_have_text("4")

    _go(page, "keys")
    expect(page.locator("#new-secret")).to_have_count(0)  # the secret never shows again
    expect(named_row(page, "web").locator("td[data-label='Last used']")).not_to_have_text("never")

    _go(page, "usage")
    expect(page.locator(".chart", has_text="Tokens by tenant")).to_contain_text(f"acme{tokens}")
    expect(page.locator(".chart", has_text="Tokens by adapter")).to_contain_text(
        "acme / support-bot"
    )
    billing = page.locator("section", has_text="Billing")
    expect(billing.locator("td[data-label=Requests]")).to_have_text("1")
    with page.expect_download() as download:
        page.click("#billing-csv")
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert [r["tenant"] for r in rows] == ["acme"]
    assert int(rows[0]["prompt_tokens"]) == done.usage.prompt_tokens
    assert int(rows[0]["completion_tokens"]) == done.usage.completion_tokens
    assert download.value.suggested_filename.startswith("loraplex-billing-")

    # --- overview polls live figures --------------------------------------------------------
    _go(page, "overview")
    expect(page.locator("#t-kv .sub")).to_contain_text("blocks")
    # the base model's family, as /v1/models names it
    expect(page.get_by_text("on replica")).to_contain_text("(llama)")
    expect(page.locator("#t-adapters .big")).to_contain_text("/")
    # The adapter the completion used was loaded once: the tile gives the loads' mean time.
    expect(page.locator("#t-adapters .sub")).to_contain_text(" ms)", timeout=15_000)
    with page.expect_request(lambda r: r.url.endswith("/admin/api/stats")):
        pass  # the next poll comes by itself, without a reload

    for name in PAGES:
        _go(page, name)
        page.wait_for_load_state("networkidle")
        _shoot(page, artifacts, name)

    # --- suspend, revoke, delete, sign out --------------------------------------------------
    _go(page, "tenants")
    page.locator("tr", has_text="acme").get_by_role("button", name="Suspend").click()
    expect(page.locator("tr", has_text="acme")).to_contain_text("suspended")
    with_key = httpx.get(
        f"{ui_server.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}
    )
    assert with_key.status_code == 401
    page.locator("tr", has_text="acme").get_by_role("button", name="Activate").click()
    expect(page.locator("tr", has_text="acme")).to_contain_text("active")

    _go(page, "keys")
    named_row(page, "web").get_by_role("button", name="Revoke").click()
    expect(named_row(page, "web")).to_contain_text("revoked")

    _go(page, "adapters")
    page.locator("tr", has_text="support-bot").get_by_role("button", name="Delete").click()
    expect(page.locator("tr", has_text="support-bot")).to_have_count(0)
    assert _admin_get(ui_server, "/adapters")["data"] == []

    page.click("#signout")
    expect(page).to_have_url(f"{ui_server.url}/admin/login")
    page.goto("/admin")
    expect(page).to_have_url(f"{ui_server.url}/admin/login")

    assert page.watch.errors == []
    assert page.watch.foreign == []
