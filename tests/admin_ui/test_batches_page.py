"""The dashboard's batches page: a tenant's Batch API jobs with their state and progress,
refreshed while one runs; and the admin API behind it."""

from __future__ import annotations

from datetime import timedelta

import httpx
from playwright.sync_api import expect

from loraplex.platform.db.models import Batch, BatchLine, utcnow
from tests.admin_ui.test_dashboard import _go, _shoot
from tests.utils.server import ADMIN_KEY


def _batch(session, tenant: int, bid: str, status: str, total: int, done: int, failed: int = 0,
           **stamps) -> None:  # fmt: skip
    now = utcnow()
    # Leased to another replica far ahead: this server's runner leaves the rows alone.
    session.add(Batch(id=bid, tenant_id=tenant, input_file_id="file-in", completion_window="24h",
                      endpoint="/v1/chat/completions", status=status, total=total,
                      runner="replica-b", lease_until=now + timedelta(days=1), created_at=now,
                      expires_at=now + timedelta(hours=24), **stamps))  # fmt: skip
    session.flush()
    _lines(session, bid, range(done), ok=True)
    _lines(session, bid, range(done, done + failed), ok=False)


def _lines(session, bid: str, lines, ok: bool) -> None:
    session.add_all(BatchLine(batch_id=bid, line=i, ok=ok, result="{}") for i in lines)
    session.commit()


def test_a_tenants_batches_with_progress(page, ui_server, artifacts):
    tenant, _ = ui_server.new_tenant("labeller")
    now = utcnow()
    with ui_server.sessions() as session:
        _batch(session, tenant, "batch_done", "completed", 120, 118, 2,
               in_progress_at=now, completed_at=now, output_file_id="file-out")  # fmt: skip
        _batch(session, tenant, "batch_running", "in_progress", 2000, 640, 3, in_progress_at=now)

    r = httpx.get(f"{ui_server.url}/admin/api/tenants/{tenant}/batches",
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
    counts = {b["id"]: b["request_counts"] for b in r.json()["data"]}
    assert counts["batch_running"] == {"total": 2000, "completed": 640, "failed": 3}
    for path, status in (
        ("/tenants/999999/batches", 404),
        (f"/tenants/{tenant}/batches?limit=0", 400),
    ):
        r = httpx.get(
            f"{ui_server.url}/admin/api{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert httpx.get(f"{ui_server.url}/admin/api/tenants/{tenant}/batches").status_code == 401

    page.goto("/admin")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    _go(page, "tenants")
    page.locator("tr", has_text="labeller").get_by_role("link", name="Batches").click()
    running = page.locator("#batches tr", has_text="batch_running")
    expect(running).to_contain_text("in_progress")
    expect(running).to_contain_text("643 / 2,000")
    expect(running).to_contain_text("(3 failed)")
    expect(running.locator("progress")).to_have_attribute("value", "643")
    expect(page.locator("#batches tr", has_text="batch_done")).to_contain_text("file-out")
    _shoot(page, artifacts, "batches")
    # Lines answered meanwhile show up without a reload: the page polls while a batch runs.
    with ui_server.sessions() as session:
        _lines(session, "batch_running", range(643, 1500), ok=True)
    expect(running).to_contain_text("1,500 / 2,000", timeout=10_000)
    assert page.watch.errors == [] and page.watch.foreign == []
