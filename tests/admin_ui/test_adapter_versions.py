"""The dashboard's adapter versions: an adapter uploaded twice lists two versions; promote,
roll back and split its default alias from the page (each through the admin API), and a
version an alias still uses is refused deletion with the server's reason."""

from __future__ import annotations

import httpx
from playwright.sync_api import expect

from tests.admin_ui.conftest import PHONE
from tests.admin_ui.test_dashboard import _go, _shoot
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import folder_parts, upload


def test_versions_promote_rollback_split_and_delete(page, ui_server, tiny_adapters, artifacts):
    tenant, key = ui_server.new_tenant("canary-co")
    for spec in ("qv4", "attn8"):  # rank 4, then rank 8: v1 and v2 of one name
        r = upload(ui_server.url, key, "sql", folder_parts(tiny_adapters["llama"][spec]))
        assert r.status_code == 201, r.text

    def aliases() -> dict:
        r = httpx.get(f"{ui_server.url}/admin/api/tenants/{tenant}/adapters/sql",
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["aliases"]

    page.goto("/admin")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    _go(page, "adapters")
    row = page.locator("tr", has_text="canary-co")
    expect(row.locator("td[data-label=Versions]")).to_have_text("v1, v2")
    expect(row.locator("td[data-label=Rank]")).to_have_text("8")  # the newest version's
    row.get_by_role("button", name="Versions").click()

    panel = page.locator("#adapter-versions")
    version = {
        v: panel.locator("#version-list tr", has=page.locator("td[data-label=Version]", has_text=v))
        for v in ("v1", "v2")
    }
    default = panel.locator("#alias-list tr", has_text="sql")
    expect(version["v1"].locator("td[data-label=Aliases]")).to_have_text("default")
    expect(version["v2"].locator("td[data-label=Aliases]")).to_have_text("")
    expect(version["v2"].locator("td[data-label=Rank]")).to_have_text("8")
    expect(default.locator("td[data-label=Traffic]")).to_have_text("v1")
    expect(version["v1"].get_by_role("button", name="Promote")).to_have_count(0)

    version["v2"].get_by_role("button", name="Promote").click()
    expect(default.locator("td[data-label=Traffic]")).to_have_text("v2")
    expect(version["v2"].locator("td[data-label=Aliases]")).to_have_text("default")
    assert aliases() == {"default": {"v2": 100}}

    default.get_by_role("button", name="Roll back").click()
    expect(default.locator("td[data-label=Traffic]")).to_have_text("v1")
    assert aliases() == {"default": {"v1": 100}}

    version["v1"].get_by_role("button", name="Delete").click()  # confirm() is accepted
    expect(page.locator("#flash.error")).to_contain_text("in use by alias default")
    expect(version["v1"]).to_have_count(1)

    panel.locator("#split-form input[name=weights]").fill("v1=90 v2=10")
    panel.locator("#split-form button[type=submit]").click()
    expect(default.locator("td[data-label=Traffic]")).to_have_text("v1 90% · v2 10%")
    expect(version["v2"].locator("td[data-label=Aliases]")).to_have_text("default 10%")
    assert aliases() == {"default": {"v1": 90, "v2": 10}}
    page.evaluate("document.getElementById('flash').hidden = true")
    _shoot(page, artifacts, "adapter-versions")
    page.set_viewport_size(PHONE)
    assert page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth") <= 0

    page.goto("/admin#overview")  # a link straight to a name's panel
    page.goto(f"/admin#adapters?tenant={tenant}&name=sql")
    expect(page.locator("#adapter-versions h2")).to_have_text("canary-co / sql")

    # The only console errors: the browser's log line of the refused (409) delete.
    assert [e for e in page.watch.errors if "409 (Conflict)" not in e] == []
    assert page.watch.foreign == []
