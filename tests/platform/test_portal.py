"""The tenant portal's backend: sign-in with an API key, the cookie session and its CSRF
rule, and a tenant seeing and changing only its own adapters, keys and usage."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from loraplex.platform.admin_session import new_portal_session, portal_session
from loraplex.platform.db import crud
from loraplex.platform.usage import record_usage
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.uploads import folder_parts


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # The engine in a thread of this process: these tests are about the registry, not engines.
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("portal"),
                    engine_process=False) as srv:  # fmt: skip
        yield srv


class Portal:
    """A browser-like client signed in to the portal: cookie jar + the session's CSRF token."""

    def __init__(self, server, key: str):
        self.http = httpx.Client(base_url=server.url, timeout=60)
        r = self.http.post("/portal/login", data={"api_key": key})
        assert r.status_code == 303 and r.headers["location"] == "/portal", r.text
        self.csrf = self.http.get("/portal/session").json()["csrf_token"]

    def get(self, path: str, **kw) -> httpx.Response:
        return self.http.get(f"/portal/api{path}", **kw)

    def send(self, method: str, path: str, **kw) -> httpx.Response:
        headers = {"X-CSRF-Token": self.csrf} | kw.pop("headers", {})
        return self.http.request(method, f"/portal/api{path}", headers=headers, **kw)


def test_sign_in_and_session_rules(server):
    tenant_id, key = server.new_tenant("signin")
    anon = httpx.Client(base_url=server.url)
    assert anon.get("/portal").headers["location"] == "/portal/login"
    login = anon.get("/portal/login")
    assert login.status_code == 200 and "script-src 'self'" in login.headers[
        "content-security-policy"]  # fmt: skip
    assert anon.get("/portal/api/account").status_code == 401
    # A wrong key, an admin key: back to the form, no cookie.
    for bad in ("lpx_nope", ADMIN_KEY):
        r = anon.post("/portal/login", data={"api_key": bad})
        assert r.headers["location"] == "/portal/login?error=1" and not anon.cookies

    portal = Portal(server, key)
    cookie = next(c for c in portal.http.cookies.jar if c.name == "lpx_portal")
    assert cookie.path == "/portal" and cookie.has_nonstandard_attr("HttpOnly")
    assert portal.http.get("/portal").status_code == 200
    assert portal.get("/account").json()["tenant"]["id"] == tenant_id
    # State changes need the CSRF header; the admin dashboard does not take a portal cookie.
    r = portal.send("POST", "/keys", json={"name": "x"}, headers={"X-CSRF-Token": "forged"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    assert portal.http.get("/admin/api/stats").status_code in (401, 403)
    # A portal cookie signed for another purpose (or tampered) is refused.
    forged, _ = new_portal_session("another-server-key" + "x" * 20, tenant_id, 1)
    assert portal_session(ADMIN_KEY, forged) is None
    assert portal.send("POST", "/keys", json={}).status_code == 201  # with the token, it works
    assert (
        portal.http.post("/portal/logout", headers={"X-CSRF-Token": portal.csrf}).status_code == 204
    )


def test_a_tenant_sees_and_changes_only_its_own(server, tiny_adapters):
    a_id, a_key = server.new_tenant("alpha")
    b_id, b_key = server.new_tenant("bravo")
    alpha, bravo = Portal(server, a_key), Portal(server, b_key)

    files = folder_parts(tiny_adapters["llama"]["qv4"])
    r = alpha.send("POST", "/adapters", data={"name": "secret-sauce"}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "secret-sauce"
    # Same validation and errors as POST /v1/adapters.
    r = alpha.send("POST", "/adapters", data={"name": "bad"}, files=files[:1])
    assert r.status_code == 400 and "adapter_model.safetensors" in r.json()["error"]["message"]
    r = alpha.send("POST", "/adapters", data={"name": "-no"}, files=files)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name"

    assert [a["name"] for a in alpha.get("/adapters").json()["data"]] == ["secret-sauce"]
    assert bravo.get("/adapters").json()["data"] == []
    assert bravo.get("/adapters/secret-sauce").status_code == 404
    assert bravo.send("DELETE", "/adapters/secret-sauce").status_code == 404
    assert alpha.get("/adapters/secret-sauce").json()["rank"] == 4

    # Keys: bravo can neither list nor revoke alpha's.
    alpha_keys = alpha.get("/keys").json()["data"]
    assert [k["tenant_id"] for k in alpha_keys] == [a_id] and alpha_keys[0]["current"]
    assert {k["tenant_id"] for k in bravo.get("/keys").json()["data"]} == {b_id}
    r = bravo.send("POST", f"/keys/{alpha_keys[0]['id']}/revoke")
    assert r.status_code == 404
    assert alpha.get("/account").status_code == 200  # alpha's key still works

    # Usage: each sees its own rows only.
    with server.sessions() as session:
        record_usage(session, request_id="alpha-1", tenant_id=a_id, model="secret-sauce",
                     adapter_name="secret-sauce", prompt_tokens=10, completion_tokens=5,
                     status="ok", latency_ms=3)  # fmt: skip
    assert len(alpha.get("/usage").json()["data"]) == 1
    assert bravo.get("/usage").json()["data"] == []

    r = alpha.send("DELETE", "/adapters/secret-sauce")
    assert r.status_code == 200 and alpha.get("/adapters").json()["data"] == []


def test_keys_created_once_and_revoking_the_session_key_ends_it(server):
    tenant_id, key = server.new_tenant("keys")
    portal = Portal(server, key)
    r = portal.send("POST", "/keys", json={"name": "ci"})
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    created = r.json()
    assert created["secret"].startswith("lpx_") and created["tenant_id"] == tenant_id
    listed = portal.get("/keys").json()["data"]
    assert "secret" not in listed[-1] and listed[-1]["name"] == "ci"
    # The new key works for inference-side auth right away.
    models = httpx.get(f"{server.url}/v1/models",
                       headers={"Authorization": f"Bearer {created['secret']}"})  # fmt: skip
    assert models.status_code == 200
    r = portal.send("POST", "/keys", json={"name": "bad name!"})
    assert r.status_code in (400, 422) and "error" in r.json()

    current = next(k for k in listed if k["current"])
    assert portal.send("POST", f"/keys/{current['id']}/revoke").json()["revoked_at"]
    r = portal.get("/account")
    assert r.status_code == 401 and r.json()["error"]["code"] == "no_session"


def test_account_quotas_and_usage_with_costs(server):
    with server.sessions() as session:
        tenant = crud.create_tenant(session, name="costs", price_prompt_per_1k="0.5",
                                    price_completion_per_1k="2")  # fmt: skip
        crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=10_000, max_adapters=3,
                       requests_per_min=60)  # fmt: skip
        key, _ = crud.create_key(session, tenant_id=tenant.id)
        now = datetime.now(UTC)
        day1 = now.replace(day=1, hour=1)
        day2 = day1 + timedelta(days=1)
        for rid, when, adapter, p, c in [("u1", day1, None, 1000, 100), ("u2", day1, "a", 200, 50),
                                         ("u3", day2, "a", 300, 0)]:  # fmt: skip
            record_usage(session, request_id=rid, tenant_id=tenant.id, model="m",
                         adapter_name=adapter, prompt_tokens=p, completion_tokens=c,
                         status="ok", latency_ms=1, created_at=when)  # fmt: skip
    portal = Portal(server, key)
    account = portal.get("/account").json()
    assert account["limits"]["tokens_per_month"] == 10_000
    assert account["used"]["tokens_per_month"] == 1650
    assert account["left"]["tokens_per_month"] == 10_000 - 1650
    assert account["left"]["max_adapters"] == 3 and account["left"]["tokens_per_min"] is None

    report = portal.get("/usage").json()
    rows = [(r["day"], r["adapter"], r["prompt_tokens"], r["cost"]) for r in report["data"]]
    assert rows == [
        (str(day1.date()), None, 1000, "0.700000"),  # 1000 x 0.5/1k + 100 x 2/1k
        (str(day1.date()), "a", 200, "0.200000"),
        (str(day2.date()), "a", 300, "0.150000"),
    ]
    assert report["total_cost"] == "1.050000"
    r = portal.get("/usage", params={"format": "csv"})
    assert r.headers["content-type"].startswith("text/csv")
    assert "attachment" in r.headers["content-disposition"]
    parsed = list(csv.DictReader(io.StringIO(r.text)))
    assert parsed[0]["cost"] == "0.700000" and set(parsed[0]) >= {"day", "adapter", "requests"}
    latency = {r["adapter"]: r for r in portal.get("/latency").json()["data"]}
    assert list(latency) == [None, "a"]  # the base model first
    assert latency["a"]["requests"] == 2 and latency["a"]["ttft_p50_ms"] is None  # none kept
    r = portal.get("/usage", params={"start": "2026-05-02", "end": "2026-05-01"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_period"
