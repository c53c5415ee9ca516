"""Dashboard sign-in, session cookie and CSRF checks over HTTP (no model, no browser)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.admin_session import (
    SESSION_COOKIE,
    csrf_token,
    new_session,
    session_expiry,
)
from loraplex.platform.db.session import upgrade
from loraplex.platform.main import create_app
from loraplex.platform.settings import Settings

ADMIN_KEY = "dashboard-admin-key-" + "k" * 24
UI_DIR = Path(__file__).resolve().parents[2] / "admin_ui"


def _app(data_dir: Path, admin_key: str = ADMIN_KEY):
    settings = Settings(data_dir=data_dir, model=str(data_dir / "no-model"), admin_key=admin_key)
    upgrade(settings.database_url)
    return create_app(settings, load_model=False)


@pytest.fixture
def client(tmp_path):
    with TestClient(_app(tmp_path), follow_redirects=False) as c:
        yield c


def _sign_in(client: TestClient, key: str = ADMIN_KEY):
    return client.post("/admin/login", data={"admin_key": key})


def _csrf(client: TestClient) -> str:
    r = client.get("/admin/session")
    assert r.status_code == 200, r.text
    return r.json()["csrf_token"]


def test_dashboard_needs_sign_in(client):
    r = client.get("/admin")
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    assert client.get("/admin/api/tenants").status_code == 401
    page = client.get("/admin/login")
    assert page.status_code == 200 and 'name="admin_key"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_wrong_key_sets_no_cookie(client):
    r = _sign_in(client, ADMIN_KEY + "x")
    assert r.status_code == 303 and r.headers["location"] == "/admin/login?error=1"
    assert SESSION_COOKIE not in r.cookies
    assert client.get("/admin").status_code == 303


def test_sign_in_sets_a_strict_httponly_cookie(client):
    r = _sign_in(client)
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/admin", "Max-Age="):
        assert attribute.lower() in cookie.lower(), cookie
    assert ADMIN_KEY not in cookie  # the key itself never goes into the browser's jar
    page = client.get("/admin")
    assert page.status_code == 200 and 'src="/admin/static/app.js"' in page.text


def test_state_changes_need_the_csrf_header(client):
    _sign_in(client)
    assert client.get("/admin/api/tenants").json()["data"] == []
    refused = client.post("/admin/api/tenants", json={"name": "forged"})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_failed"
    wrong = client.post(
        "/admin/api/tenants", json={"name": "forged"}, headers={"X-CSRF-Token": "0" * 64}
    )
    assert wrong.status_code == 403
    ok = client.post(
        "/admin/api/tenants", json={"name": "real"}, headers={"X-CSRF-Token": _csrf(client)}
    )
    assert ok.status_code == 201, ok.text
    names = [t["name"] for t in client.get("/admin/api/tenants").json()["data"]]
    assert names == ["real"]


def test_bearer_admin_key_still_works_without_csrf(client):
    r = client.post(
        "/admin/api/tenants", json={"name": "cli"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert r.status_code == 201, r.text


def test_sign_out_needs_csrf_and_clears_the_cookie(client):
    _sign_in(client)
    assert client.post("/admin/logout").status_code == 403
    r = client.post("/admin/logout", headers={"X-CSRF-Token": _csrf(client)})
    assert r.status_code == 204
    assert client.get("/admin").status_code == 303


def test_tampered_or_foreign_cookie_is_refused(client):
    value, _ = new_session(ADMIN_KEY)
    body, _, mac = value.rpartition(".")
    later = body.split(".")
    later[1] = str(int(later[1]) + 10**6)  # stretch the expiry, keep the old signature
    forged = ".".join(later) + "." + mac
    foreign, _ = new_session("another-admin-key-" + "z" * 24)
    for bad in (forged, foreign, "v1.99999999999.x", ""):
        client.cookies.set(SESSION_COOKIE, bad, path="/admin")
        assert client.get("/admin/api/tenants").status_code == 401
        assert client.get("/admin").status_code == 303


def test_expired_session_is_refused():
    value, expires = new_session(ADMIN_KEY, now=1_000_000)
    assert session_expiry(ADMIN_KEY, value, now=expires - 1) == expires
    assert session_expiry(ADMIN_KEY, value, now=expires) is None


def test_a_session_works_on_every_replica_sharing_the_admin_key(tmp_path):
    """Replicas keep no session table: one issued by A is accepted by B, with its CSRF token."""
    a, b = _app(tmp_path / "a"), _app(tmp_path / "b")
    other = _app(tmp_path / "c", admin_key="rotated-admin-key-" + "r" * 24)
    with TestClient(a, follow_redirects=False) as ca, TestClient(b) as cb, TestClient(other) as co:
        value = _sign_in(ca).cookies[SESSION_COOKIE]
        cb.cookies.set(SESSION_COOKIE, value, path="/admin")
        headers = {"X-CSRF-Token": csrf_token(ADMIN_KEY, value)}
        assert (
            cb.post("/admin/api/tenants", json={"name": "on-b"}, headers=headers).status_code == 201
        )
        co.cookies.set(SESSION_COOKIE, value, path="/admin")
        assert co.get("/admin/api/tenants").status_code == 401


def test_every_asset_is_served_locally(client):
    """Air-gapped browsers: no page or script may reach outside the server."""
    texts = {
        p.name: p.read_text() for p in UI_DIR.rglob("*") if p.suffix in (".html", ".js", ".css")
    }
    for name, text in texts.items():
        text = text.replace("http://www.w3.org/2000/svg", "")  # a namespace name, never fetched
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
    referenced = set()
    for text in texts.values():
        referenced |= set(re.findall(r"/admin/static/([\w.-]+)", text))
        referenced |= {m for m in re.findall(r"from \"\./([\w.-]+)\"", text)}
    assert {"app.js", "app.css", "favicon.svg", "login.js", "page-usage.js"} <= referenced
    for name in referenced:
        r = client.get(f"/admin/static/{name}")
        assert r.status_code == 200, name
