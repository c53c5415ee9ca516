"""The admin API against a running server: tenants, keys, quotas, adapters, usage, billing."""

from __future__ import annotations

import csv
import io
import time
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import httpx
import openai
import pytest

from loraplex.platform.db import crud
from tests.utils.server import ADMIN_KEY, run_server


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("admin-srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def admin(server):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=f"{server.url}/admin/api", headers=headers, timeout=60) as c:
        yield c


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _tenant(admin, name: str, **fields) -> tuple[int, str]:
    """A tenant and a key for it, both made through the admin API."""
    created = admin.post("/tenants", json={"name": name, **fields})
    assert created.status_code == 201, created.text
    tenant_id = created.json()["id"]
    key = admin.post(f"/tenants/{tenant_id}/keys", json={"name": "test"})
    assert key.status_code == 201, key.text
    return tenant_id, key.json()["secret"]


def _upload(server, key: str, name: str, folder) -> None:
    files = [("files", (f, (folder / f).read_bytes()))
             for f in ("adapter_config.json", "adapter_model.safetensors")]  # fmt: skip
    r = httpx.post(f"{server.url}/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                   data={"name": name}, files=files, timeout=60)  # fmt: skip
    assert r.status_code == 201, r.text


def _wait_for_usage(admin, tenant_id: int, requests: int) -> None:
    # A request's usage record is written as it ends, possibly just after the response.
    for _ in range(200):
        rows = admin.get("/usage", params={"tenant_id": tenant_id}).json()["data"]
        if rows and rows[0]["requests"] >= requests:
            return
        time.sleep(0.05)
    raise AssertionError(f"tenant {tenant_id} has no {requests} usage records")


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_admin_routes_refuse_missing_and_tenant_keys(server, admin):
    _, tenant_key = _tenant(admin, "outsider")
    routes = [("GET", "/tenants"), ("POST", "/tenants"), ("GET", "/adapters"),
              ("GET", "/usage"), ("GET", "/billing"), ("POST", "/keys/1/revoke")]  # fmt: skip
    for method, path in routes:
        url = f"{server.url}/admin/api{path}"
        missing = httpx.request(method, url, json={"name": "intruder"})
        assert _error(missing, 401)["type"] == "authentication_error"
        for key in (tenant_key, ADMIN_KEY + "x"):
            refused = httpx.request(
                method, url, json={"name": "intruder"}, headers={"Authorization": f"Bearer {key}"}
            )
            assert _error(refused, 403)["type"] == "permission_error"
    assert "intruder" not in [t["name"] for t in admin.get("/tenants").json()["data"]]


def test_tenant_lifecycle(admin):
    created = admin.post(
        "/tenants", json={"name": "acme", "weight": 2, "price_prompt_per_1k": "0.0015"}
    )
    assert created.status_code == 201
    acme = created.json()
    assert (acme["status"], acme["weight"]) == ("active", 2.0)
    assert Decimal(acme["price_prompt_per_1k"]) == Decimal("0.0015")
    assert _error(admin.post("/tenants", json={"name": "acme"}), 409)["code"] == "tenant_exists"
    assert _error(admin.post("/tenants", json={"name": "no spaces"}), 400)["param"] == "name"
    assert _error(admin.post("/tenants", json={"name": "typo", "wieght": 2}), 400)

    assert "acme" in [t["name"] for t in admin.get("/tenants").json()["data"]]
    assert admin.get(f"/tenants/{acme['id']}").json()["name"] == "acme"
    assert _error(admin.get("/tenants/999999"), 404)["code"] == "tenant_not_found"
    assert _error(admin.get("/tenants/acme"), 400)  # ids are numbers

    patched = admin.patch(
        f"/tenants/{acme['id']}", json={"weight": 3, "price_completion_per_1k": "0.002"}
    )
    assert patched.status_code == 200
    assert (patched.json()["weight"], Decimal(patched.json()["price_completion_per_1k"])) == (
        3.0, Decimal("0.002"),
    )  # fmt: skip
    assert Decimal(patched.json()["price_prompt_per_1k"]) == Decimal("0.0015")  # kept
    assert _error(admin.patch(f"/tenants/{acme['id']}", json={"status": "deleted"}), 400)
    assert _error(admin.patch(f"/tenants/{acme['id']}", json={}), 400)
    assert _error(admin.patch("/tenants/999999", json={"weight": 1}), 404)


def test_suspended_tenant_keys_get_401_until_reactivated(server, admin):
    tenant_id, key = _tenant(admin, "suspendable")
    client = _client(server, key)
    assert client.models.list().data
    assert (
        admin.patch(f"/tenants/{tenant_id}", json={"status": "suspended"}).json()["status"]
        == "suspended"
    )
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    admin.patch(f"/tenants/{tenant_id}", json={"status": "active"})
    assert client.models.list().data


def test_key_secret_is_shown_once_and_revoked_keys_fail(server, admin):
    tenant_id, _ = _tenant(admin, "keyholder")
    created = admin.post(f"/tenants/{tenant_id}/keys", json={"name": "ci"})
    assert created.headers["cache-control"] == "no-store"
    key = created.json()
    assert key["secret"].startswith("lpx_") and key["prefix"] == key["secret"][:12]
    client = _client(server, key["secret"])
    assert client.completions.create(model=server.state.model_name, prompt="hi", max_tokens=1)

    listing = admin.get(f"/tenants/{tenant_id}/keys")
    assert key["secret"] not in listing.text and "key_hash" not in listing.text
    assert key["prefix"] in [k["prefix"] for k in listing.json()["data"]]

    revoked = admin.post(f"/keys/{key['id']}/revoke")
    assert revoked.json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    other = admin.post(f"/tenants/{tenant_id}/keys").json()  # the body is optional
    assert admin.delete(f"/keys/{other['id']}").json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        _client(server, other["secret"]).models.list()

    assert _error(admin.post("/keys/999999/revoke"), 404)["code"] == "key_not_found"
    assert _error(admin.post("/tenants/999999/keys"), 404)
    past = {"expires_at": "2000-01-01T00:00:00Z"}
    assert "past" in _error(admin.post(f"/tenants/{tenant_id}/keys", json=past), 400)["message"]


def test_quota_put_replaces_limits_and_is_enforced(server, admin):
    tenant_id, key = _tenant(admin, "limited")
    assert admin.get(f"/tenants/{tenant_id}/quota").json()["requests_per_min"] is None
    put = admin.put(f"/tenants/{tenant_id}/quota", json={"requests_per_min": 1, "max_rank": 8})
    assert (put.json()["requests_per_min"], put.json()["tokens_per_min"]) == (1, None)
    assert admin.get(f"/tenants/{tenant_id}/quota").json()["max_rank"] == 8
    typo = admin.put(f"/tenants/{tenant_id}/quota", json={"requests_per_minute": 5})
    assert _error(typo, 400)
    assert _error(admin.put(f"/tenants/{tenant_id}/quota", json={"max_rank": -1}), 400)

    client = _client(server, key)
    client.completions.create(model=server.state.model_name, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=server.state.model_name, prompt="hi", max_tokens=1)


def test_adapters_across_tenants_and_delete_cleans_the_store(server, admin, tiny_adapters):
    a_id, a_key = _tenant(admin, "owner-a")
    b_id, b_key = _tenant(admin, "owner-b")
    _upload(server, a_key, "shared", tiny_adapters["llama"]["qv4"])
    _upload(server, b_key, "shared", tiny_adapters["llama"]["qv4"])  # same bytes, own object
    _upload(server, a_key, "mine", tiny_adapters["llama"]["attn8"])

    everyone = admin.get("/adapters").json()["data"]
    ours = [(a["tenant"], a["name"]) for a in everyone if a["tenant_id"] in (a_id, b_id)]
    assert ours == [("owner-a", "mine"), ("owner-a", "shared"), ("owner-b", "shared")]
    assert "storage_key" not in everyone[0]
    only_b = admin.get("/adapters", params={"tenant_id": b_id}).json()["data"]
    assert [a["name"] for a in only_b] == ["shared"]
    assert _error(admin.get("/adapters", params={"tenant_id": 999999}), 404)

    with server.sessions() as session:
        key_a = crud.get_adapter(session, tenant_id=a_id, name="shared").storage_key
        key_b = crud.get_adapter(session, tenant_id=b_id, name="shared").storage_key
    assert key_a != key_b  # one tenant's delete can never touch what another's uses
    store = server.state.store
    assert admin.delete(f"/tenants/{a_id}/adapters/shared").json()["deleted"] is True
    assert not store.exists(key_a) and store.exists(key_b)
    assert "shared" not in [m.id for m in _client(server, a_key).models.list().data]
    assert "shared" in [m.id for m in _client(server, b_key).models.list().data]
    admin.delete(f"/tenants/{b_id}/adapters/shared")
    assert not store.exists(key_b)
    assert (
        _error(admin.delete(f"/tenants/{b_id}/adapters/shared"), 404)["code"] == "adapter_not_found"
    )


def test_usage_by_tenant_adapter_and_day(server, admin, tiny_adapters):
    tenant_id, key = _tenant(admin, "metered")
    _upload(server, key, "qv", tiny_adapters["llama"]["qv4"])
    client = _client(server, key)
    responses = [
        client.completions.create(model=model, prompt="Once upon a time", max_tokens=n)
        for model, n in ((server.state.model_name, 4), ("qv", 3), ("qv", 2))
    ]
    _wait_for_usage(admin, tenant_id, 3)

    def report(**params):
        r = admin.get("/usage", params={"tenant_id": tenant_id, **params})
        assert r.status_code == 200, r.text
        return r.json()["data"]

    (total,) = report(group_by="tenant")
    assert (total["tenant"], total["requests"]) == ("metered", 3)
    assert total["prompt_tokens"] == sum(r.usage.prompt_tokens for r in responses)
    assert total["completion_tokens"] == sum(r.usage.completion_tokens for r in responses) == 9
    by_adapter = {row["adapter"]: row for row in report(group_by="adapter")}
    assert by_adapter.keys() == {None, "qv"}  # None: the base model
    assert (by_adapter[None]["completion_tokens"], by_adapter["qv"]["completion_tokens"]) == (4, 5)
    today = datetime.now(UTC).date()
    assert [(d["day"], d["requests"]) for d in report(group_by="day")] == [(str(today), 3)]
    assert report(start=str(today + timedelta(days=1)), end=str(today + timedelta(days=2))) == []
    assert report(start=str(today), end=str(today))[0]["requests"] == 3  # a date end is inclusive

    assert (
        _error(admin.get("/usage", params={"start": "yesterday"}), 400)["code"] == "invalid_period"
    )
    backwards = {"start": "2024-05-02", "end": "2024-05-01"}
    assert "empty period" in _error(admin.get("/usage", params=backwards), 400)["message"]
    assert _error(admin.get("/usage", params={"group_by": "week"}), 400)
    assert _error(admin.get("/usage", params={"tenant_id": 999999}), 404)


def _cost(tokens: int, price: str) -> Decimal:
    return (tokens * Decimal(price) / 1000).quantize(Decimal("0.000001"), ROUND_HALF_UP)


def test_billing_csv_download_costs_tokens_at_the_tenants_prices(server, admin):
    prices = {"price_prompt_per_1k": "0.0015", "price_completion_per_1k": "2.5"}
    tenant_id, key = _tenant(admin, "billed", **prices)
    client = _client(server, key)
    responses = [
        client.completions.create(model=server.state.model_name, prompt=p, max_tokens=n)
        for p, n in (("Hello there", 5), ("The weather today is", 7))
    ]
    _wait_for_usage(admin, tenant_id, 2)
    prompt = sum(r.usage.prompt_tokens for r in responses)
    completion = sum(r.usage.completion_tokens for r in responses)
    expected = _cost(prompt, "0.0015") + _cost(completion, "2.5")

    download = admin.get("/billing", params={"format": "csv", "tenant_id": tenant_id})
    assert download.status_code == 200 and download.headers["content-type"].startswith("text/csv")
    disposition = download.headers["content-disposition"]
    assert disposition.startswith("attachment;") and disposition.endswith('.csv"')
    (row,) = list(csv.DictReader(io.StringIO(download.text)))
    assert row["tenant"] == "billed"
    assert (int(row["prompt_tokens"]), int(row["completion_tokens"])) == (prompt, completion)
    assert (
        Decimal(row["cost"])
        == expected
        == Decimal(row["prompt_cost"]) + Decimal(row["completion_cost"])
    )

    everyone = admin.get("/billing").json()  # JSON by default, all tenants, this month
    mine = [r for r in everyone["data"] if r["tenant_id"] == tenant_id]
    assert Decimal(mine[0]["cost"]) == expected  # amounts are exact decimal strings
    assert Decimal(everyone["total_cost"]) == sum(Decimal(r["cost"]) for r in everyone["data"])
    assert everyone["period_start"].startswith(datetime.now(UTC).strftime("%Y-%m-01"))
    assert _error(admin.get("/billing", params={"format": "xml"}), 400)
