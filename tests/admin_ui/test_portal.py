"""The tenant portal in a real browser: a tenant's whole flow, and a second tenant who sees
none of it.

alpha signs in with an API key (a wrong one first), reads its quotas, drops an incomplete
adapter (the server's reason shows) and then a whole one, opens its details, serves a
completion with it, creates and revokes a key, reads its usage and cost and downloads the
CSV. bravo then signs in and finds no trace of alpha's adapter, keys or usage. Every page is
photographed at desktop and phone width (into docs/screenshots with LORAPLEX_SCREENSHOTS_DIR).
"""

from __future__ import annotations

import base64
import csv
import io
import os
import shutil
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from loraplex.platform.db import crud
from tests.admin_ui.conftest import DESKTOP, PHONE, Watch
from tests.admin_ui.rows import named_row
from tests.utils.uploads import ADAPTER_FILES


@pytest.fixture
def shots() -> Path:
    out = Path(os.environ.get("LORAPLEX_ARTIFACTS", "/tmp/artifacts")) / "portal"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def _shoot(page, shots: Path, name: str) -> None:
    """Full-page screenshots at desktop and phone width; at phone width nothing may stick
    out sideways (the page would scroll horizontally)."""
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(150)  # one frame for the layout to settle at the new width
        wide = page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"{name} at {label} width is {wide}px too wide"
        page.screenshot(path=shots / f"portal-{name}-{label}.png", full_page=True)
    page.set_viewport_size(DESKTOP)
    docs = os.environ.get("LORAPLEX_SCREENSHOTS_DIR")
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
        for label in ("desktop", "phone"):
            name_ = f"portal-{name}-{label}.png"
            shutil.copy(shots / name_, Path(docs) / name_)


def _go(page, name: str) -> None:
    if page.url.endswith(f"/portal#{name}"):
        page.reload()  # a fragment navigation to the same page would not load it again
    else:
        page.goto(f"/portal#{name}")
    expect(page.locator(f"main[data-page={name}] h1")).to_be_visible()
    page.wait_for_load_state("networkidle")


def _drop(page, files: dict[str, bytes]) -> None:
    """Drop files on the upload zone as a desktop's file manager would."""
    payload = [{"name": n, "b64": base64.b64encode(b).decode()} for n, b in files.items()]
    page.evaluate(
        """(files) => {
          const dt = new DataTransfer();
          for (const f of files) {
            const bytes = Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0));
            dt.items.add(new File([bytes], f.name));
          }
          const zone = document.getElementById("dropzone");
          for (const kind of ["dragenter", "dragover", "drop"]) {
            const init = { dataTransfer: dt, bubbles: true, cancelable: true };
            zone.dispatchEvent(new DragEvent(kind, init));
          }
        }""",
        payload,
    )


def _sign_in(page, url: str, key: str) -> None:
    page.goto("/portal")
    expect(page).to_have_url(f"{url}/portal/login")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=account] h1")).to_be_visible()


def test_tenant_portal_two_tenants(browser, ui_server, tiny_adapters, shots):
    with ui_server.sessions() as session:
        alpha = crud.create_tenant(session, name="alpha", price_prompt_per_1k="0.5",
                                   price_completion_per_1k="2")  # fmt: skip
        crud.set_quota(session, tenant_id=alpha.id, tokens_per_month=50_000, max_adapters=2,
                       requests_per_min=30, max_adapter_bytes=10 * 1024**2)  # fmt: skip
        alpha_key, _ = crud.create_key(session, tenant_id=alpha.id, name="laptop")
        bravo = crud.create_tenant(session, name="bravo")
        bravo_key, _ = crud.create_key(session, tenant_id=bravo.id, name="bravo-main")
    url = ui_server.url
    folder = tiny_adapters["llama"]["qv4"]
    files = {n: (folder / n).read_bytes() for n in ADAPTER_FILES}

    context = browser.new_context(base_url=url, viewport=DESKTOP, accept_downloads=True)
    page = context.new_page()
    page.watch = Watch(url)
    page.watch.attach(page)
    page.on("dialog", lambda d: d.accept())

    # --- sign in (a wrong key first) -------------------------------------------------------
    page.goto("/portal")
    expect(page).to_have_url(f"{url}/portal/login")
    _shoot(page, shots, "signin")
    page.fill("#api_key", "lpx_not-a-key")
    page.click("button[type=submit]")
    expect(page.locator("#error")).to_be_visible()
    page.fill("#api_key", alpha_key)
    page.click("button[type=submit]")
    expect(page.locator("main[data-page=account] h1")).to_have_text("Account alpha")
    cookie = next(c for c in context.cookies() if c["name"] == "lpx_portal")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/portal"
    expect(page.locator("#who")).to_contain_text("alpha")
    expect(page.locator("#q-tokens_per_month")).to_contain_text("50,000 left")
    expect(page.locator("#q-max_adapters")).to_contain_text("0 of 2 used")
    expect(page.locator("#prices")).to_contain_text("Prompt tokens 0.5 and completion tokens 2 per")

    # --- adapters: an incomplete drop is refused with the server's reason, then a whole one --
    _go(page, "adapters")
    _drop(page, {"adapter_config.json": files["adapter_config.json"]})
    expect(page.locator("#chosen")).to_contain_text("adapter_config.json")
    page.fill("#adapter-name", "support-bot")
    page.click("#upload")
    expect(page.locator("#upload-error")).to_contain_text("adapter_model.safetensors")
    _drop(page, files)
    expect(page.locator("#chosen")).to_contain_text("2 files")
    page.click("#upload")
    row = page.locator("#adapters tr", has_text="support-bot")
    expect(row).to_contain_text("ready")
    expect(page.locator("#upload-error")).to_be_hidden()
    row.get_by_role("button", name="Details").click()
    details = page.locator("#adapter-details")
    expect(details).to_contain_text("q_proj")
    sha = httpx.get(f"{url}/v1/adapters/support-bot",
                    headers={"Authorization": f"Bearer {alpha_key}"}).json()["sha256"]  # fmt: skip
    expect(details.locator("code.digest")).to_have_text(sha)
    _shoot(page, shots, "adapters")

    # --- a second version under the name: listed, promoted from the page, rolled back --------
    attn8 = tiny_adapters["llama"]["attn8"]
    _drop(page, {n: (attn8 / n).read_bytes() for n in ADAPTER_FILES})
    page.fill("#adapter-name", "support-bot")
    page.click("#upload")
    expect(row.locator("td[data-label=Versions]")).to_have_text("v1, v2")
    expect(row.locator("td[data-label=Default]")).to_have_text("v1")  # not promoted
    row.get_by_role("button", name="Details").click()
    v2 = page.locator("#version-list tr", has=page.locator("td[data-label=Version]", has_text="v2"))
    v2.get_by_role("button", name="Promote").click()
    expect(row.locator("td[data-label=Default]")).to_have_text("v2")
    expect(v2.locator("td[data-label=Aliases]")).to_have_text("default")
    page.locator("#alias-list tr", has_text="default").get_by_role(
        "button", name="Roll back"
    ).click()
    expect(row.locator("td[data-label=Default]")).to_have_text("v1")
    page.evaluate("document.getElementById('flash').hidden = true")
    _shoot(page, shots, "adapter-versions")

    # --- a completion with it, as alpha's application would --------------------------------
    done = httpx.post(f"{url}/v1/completions",
                      headers={"Authorization": f"Bearer {alpha_key}"},
                      json={"model": "support-bot", "prompt": "Hello", "max_tokens": 5,
                            "ignore_eos": True}, timeout=60).json()  # fmt: skip
    tokens = done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]

    # --- keys: create (shown once), then revoke it ------------------------------------------
    _go(page, "keys")
    expect(named_row(page, "laptop", "#keys tr")).to_contain_text("this session")
    page.locator("#create-key input[name=name]").fill("ci")
    page.locator("#create-key button[type=submit]").click()
    secret = page.locator("#new-secret").input_value()
    assert secret.startswith("lpx_")
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert ok.status_code == 200
    _shoot(page, shots, "keys-secret")
    named_row(page, "ci", "#keys tr").get_by_role("button", name="Revoke").click()
    expect(named_row(page, "ci", "#keys tr")).to_contain_text("revoked")
    refused = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert refused.status_code == 401
    _go(page, "keys")
    expect(page.locator("#new-secret")).to_have_count(0)  # the secret never shows again

    # --- usage and cost, CSV -----------------------------------------------------------------
    _go(page, "usage")
    table = page.locator("#usage-table")
    expect(table.locator("td[data-label=Adapter]")).to_have_text("support-bot")
    expect(table.locator("td[data-label=Requests]")).to_have_text("1")
    cost = (done["usage"]["prompt_tokens"] * 0.5 + done["usage"]["completion_tokens"] * 2) / 1000
    expect(table.locator("td[data-label=Cost]")).to_have_text(f"{cost:.6f}")
    expect(page.locator(".chart", has_text="Tokens by adapter")).to_contain_text(
        f"support-bot{tokens}"
    )
    lat = page.locator("#latency-table tr", has_text="support-bot")
    expect(lat.locator("td[data-label='p50 TTFT']")).to_contain_text(" ms")
    with page.expect_download() as download:
        page.click("#usage-csv")
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert [(r["adapter"], r["requests"], r["cost"]) for r in rows] == [
        ("support-bot", "1", f"{cost:.6f}")
    ]
    assert download.value.suggested_filename.startswith("loraplex-usage-alpha-")
    _shoot(page, shots, "usage")
    _go(page, "account")
    expect(page.locator("#q-tokens_per_month")).to_contain_text(f"{tokens} of 50,000 used")
    expect(page.locator("#q-max_adapters")).to_contain_text("1 of 2 used")
    _shoot(page, shots, "account")
    # The one error: the browser's log line for the refused (400) incomplete upload.
    assert [e for e in page.watch.errors if "400 (Bad Request)" not in e] == []
    assert len(page.watch.errors) == 1 and page.watch.foreign == []

    # --- bravo, in a browser of its own, at phone width: none of alpha's --------------------
    other = browser.new_context(base_url=url, viewport=PHONE)
    bpage = other.new_page()
    bpage.watch = Watch(url)
    bpage.watch.attach(bpage)
    _sign_in(bpage, url, bravo_key)
    expect(bpage.locator("main[data-page=account] h1")).to_have_text("Account bravo")
    for name in ("adapters", "keys", "usage", "account"):
        _go(bpage, name)
        text = bpage.locator("body").inner_text()
        for trace in ("support-bot", "alpha", "laptop", alpha_key[:12], sha[:12]):
            assert trace not in text, f"bravo's {name} page shows {trace!r}"
    _go(bpage, "adapters")
    expect(bpage.locator("#adapters")).to_contain_text("No adapters yet")
    _go(bpage, "keys")
    expect(bpage.locator("#keys tbody tr")).to_have_count(1)
    expect(bpage.locator("#keys")).to_contain_text("bravo-main")
    _go(bpage, "usage")
    expect(bpage.locator("#usage-table")).to_contain_text("No usage in this month.")
    assert bpage.watch.errors == [] and bpage.watch.foreign == []
    # Asking for alpha's adapter by name, or deleting it, finds nothing (the browser logs
    # these 404s as console errors, so the check of them comes before).
    probe = bpage.evaluate(
        """async () => {
          const s = await (await fetch("/portal/session")).json();
          const get = await fetch("/portal/api/adapters/support-bot");
          const del = await fetch("/portal/api/adapters/support-bot",
            { method: "DELETE", headers: { "X-CSRF-Token": s.csrf_token } });
          return [get.status, del.status];
        }"""
    )
    assert probe == [404, 404]
    other.close()

    # --- alpha: delete the adapter, sign out ---------------------------------------------------
    _go(page, "adapters")
    page.locator("#adapters tr", has_text="support-bot").get_by_role(
        "button", name="Delete"
    ).click()
    expect(page.locator("#adapters tr", has_text="support-bot")).to_have_count(0)
    page.click("#signout")
    expect(page).to_have_url(f"{url}/portal/login")
    page.goto("/portal")
    expect(page).to_have_url(f"{url}/portal/login")
    # Revoking the key this session signed in with ends the session: back to the form.
    _sign_in(page, url, alpha_key)
    _go(page, "keys")
    named_row(page, "laptop", "#keys tr").get_by_role("button", name="Revoke").click()
    expect(page).to_have_url(f"{url}/portal/login")
    expect(page.locator("#api_key")).to_be_visible()
    # The cookie still carries a valid signature, but its key is revoked: the server itself
    # sends the browser to the form (the page must not load, fail and bounce back and forth).
    answer = page.request.get("/portal", max_redirects=0)
    assert answer.status == 303 and answer.headers["location"] == "/portal/login"
    page.goto("/portal")
    expect(page).to_have_url(f"{url}/portal/login")
    assert len(page.watch.errors) == 1 and page.watch.foreign == []
    context.close()
