"""The admin overview on a replica with KV tiers (docs/kv-tiers.md): GET /admin/api/stats
carries each tier's blocks looked up and found, hit rate and bytes, and the overview shows
them in a "KV tiers" tile. A replica without tiers shows no such tile (test_dashboard.py's
server has none: its overview is unchanged)."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from tests.utils.server import ADMIN_KEY, run_server


@pytest.fixture(scope="module")
def ui_server(tiny_models, tmp_path_factory):
    """A server with a small host tier (the page fixture serves this one)."""
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("kv-ui"), kv_tier_host_gib=0.01
    ) as srv:
        yield srv


def test_overview_shows_each_kv_tier(page, ui_server):
    _, key = ui_server.new_tenant("tierco")
    prompt = " ".join(f"word{i}" for i in range(12))  # several full blocks
    r = httpx.post(
        f"{ui_server.url}/v1/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": ui_server.state.model_name, "prompt": prompt, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text

    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    tile = page.locator("#t-kv-tiers")
    # The request's blocks were looked up (a miss: a new prompt) and written through to host;
    # the writes are the writer thread's, so the tile is polled until they show.
    expect(tile.locator(".big")).to_have_text("host 0.0 %", timeout=15_000)
    expect(tile.locator(".sub")).not_to_contain_text("0 B written", timeout=15_000)
    expect(tile.locator(".sub")).to_contain_text("held")

    stats = page.request.get("/admin/api/stats").json()["engine"]["kv_tiers"]
    host = stats["host"]
    assert host["queried"] > 0 and host["hits"] == 0 and host["hit_rate"] == 0.0
    assert host["bytes_written"] > 0 and host["bytes_stored"] > 0
    assert set(stats) == {"host"}  # only the tiers the replica has
    assert page.watch.errors == []
    assert page.watch.foreign == []


def test_tenants_page_drops_a_tenants_cached_kv(page, ui_server):
    """The tenants list's "Drop cached KV" rotates the tenant's prefix-cache salt (admin API
    POST /admin/api/tenants/{id}/cache-salt/rotate); another tenant's salt is untouched."""
    from loraplex.platform.db.models import Tenant
    from tests.admin_ui.test_dashboard import _go

    tenant, _ = ui_server.new_tenant("saltco")
    other, _ = ui_server.new_tenant("keepco")
    page.goto("/admin/login")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    _go(page, "tenants")
    page.locator("tr", has_text="saltco").get_by_role("button", name="Drop cached KV").click()
    expect(page.locator("#flash")).to_contain_text("saltco's cached KV dropped")
    with ui_server.sessions() as session:
        assert len(session.get(Tenant, tenant).cache_salt) == 64
        assert session.get(Tenant, other).cache_salt is None
    assert page.watch.errors == []
