"""Browser fixtures: Debian's chromium driven by Playwright against a real running server.

Chromium comes from Debian's package (`apt-get install chromium`), not Playwright's download,
so the tests run where only package registries are reachable. Every page's console errors,
uncaught exceptions and requests leaving the server are recorded; the tests assert none.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.utils.server import run_server

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox",  # CI runs as root in a container
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@dataclass
class Watch:
    """What went wrong in the browser, and what it tried to fetch from elsewhere."""

    base_url: str
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def attach(self, page) -> None:
        page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", self._request)

    def _request(self, request) -> None:
        if not request.url.startswith((self.base_url, "data:", "blob:")):
            self.foreign.append(request.url)


@pytest.fixture(scope="module")
def ui_server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("ui-srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no chromium at {CHROMIUM}: `apt-get install -y chromium` (the README's test "
            "command does), or point LORAPLEX_CHROMIUM at one"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture
def artifacts() -> Path:
    """Screenshots of this run (kept by CI); `LORAPLEX_SCREENSHOTS_DIR` also gets a copy."""
    out = Path(os.environ.get("LORAPLEX_ARTIFACTS", "/tmp/artifacts")) / "admin_ui"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


@pytest.fixture
def page(browser, ui_server):
    context = browser.new_context(base_url=ui_server.url, viewport=DESKTOP, accept_downloads=True)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=ui_server.url)
    page = context.new_page()
    page.watch = Watch(ui_server.url)
    page.watch.attach(page)
    page.on("dialog", lambda d: d.accept())  # confirm() before suspend, revoke, delete
    yield page
    context.close()
