"""The dashboard's "also end running streams" checkboxes: revoking a key or suspending a tenant
with it ticked ends that stream at once (an `error` event, then `[DONE]`)."""

from __future__ import annotations

import asyncio
import threading

from playwright.sync_api import expect

from loraplex.platform.db import crud
from tests.admin_ui.rows import named_row
from tests.admin_ui.test_dashboard import _go
from tests.utils.server import ADMIN_KEY
from tests.utils.sse_client import StreamResult, stream_completion

LONG = 200


class _Stream(threading.Thread):
    """A long stream in the background; `running` is set once tokens arrive."""

    def __init__(self, url: str, key: str):
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.running = threading.Event()
        self.result: StreamResult | None = None

    def run(self) -> None:
        body = {"model": "llama", "prompt": "Once upon", "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}  # fmt: skip
        self.result = asyncio.run(
            stream_completion(self.url, self.key, body, on_tokens=lambda n: self.running.set())
        )


def _start(url: str, key: str) -> _Stream:
    stream = _Stream(url, key)
    stream.start()
    assert stream.running.wait(60), "the stream never started"
    return stream


def _cut(stream: _Stream) -> None:
    stream.join(60)
    result = stream.result
    assert result is not None and result.finished and result.tokens < LONG
    assert result.error["code"] == "stream_cut"


def test_revoke_and_suspend_with_end_streams_ticked(page, ui_server):
    page.goto("/admin")
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=overview] h1")).to_have_text("Overview")

    tenant, key = ui_server.new_tenant("cutoff")
    with ui_server.sessions() as session:
        crud.create_key(session, tenant_id=tenant, name="spare")  # a second row to tell apart
    stream = _start(ui_server.url, key)
    page.goto(f"/admin#keys?tenant={tenant}")
    expect(page.locator("main[data-page=keys] h1")).to_be_visible()
    page.check("#revoke-end-streams")
    named_row(page, "default").get_by_role("button", name="Revoke").click()
    expect(named_row(page, "default")).to_contain_text("revoked")
    _cut(stream)

    _, key = ui_server.new_tenant("suspended-now")
    stream = _start(ui_server.url, key)
    _go(page, "tenants")
    page.check("#suspend-end-streams")
    page.locator("tr", has_text="suspended-now").get_by_role("button", name="Suspend").click()
    expect(page.locator("tr", has_text="suspended-now")).to_contain_text("suspended")
    _cut(stream)
    assert page.watch.errors == []
