"""A tenant's prefix-cache salt (platform/db/cache_salts.py, POST
/admin/api/tenants/{id}/cache-salt/rotate): rotating it makes the tenant's cached KV (device
pool and KV tiers) unreachable from its next request on, and keeps other tenants'.

A real server on the tiny llama with a host KV tier; `usage.prompt_tokens_details.cached_tokens`
counts the prompt tokens served from the device pool or loaded from a tier."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.db.models import Tenant
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.uploads import auth

PROMPT_A = list(range(40, 80))  # token ids: 2 full blocks of 16 and then some
PROMPT_B = list(range(120, 160))


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("salt"), kv_tier_host_gib=0.01
    ) as srv:
        yield srv


def _cached(server, key: str, prompt: list[int]) -> int:
    body = {"model": server.state.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(key), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _rotate(server, tenant_id: int, key: str = ADMIN_KEY) -> httpx.Response:
    url = f"{server.url}/admin/api/tenants/{tenant_id}/cache-salt/rotate"
    return httpx.post(url, headers=auth(key), timeout=30)


def test_rotating_a_salt_drops_only_that_tenants_cached_prefixes(server):
    a, key_a = server.new_tenant("salt-a")
    b, key_b = server.new_tenant("salt-b")
    assert _cached(server, key_a, PROMPT_A) == 0
    assert _cached(server, key_a, PROMPT_A) > 0  # A's prefix, cached
    assert _cached(server, key_b, PROMPT_B) == 0
    assert _cached(server, key_b, PROMPT_B) > 0
    assert _cached(server, key_b, PROMPT_A) == 0  # never another tenant's

    r = _rotate(server, a)
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "tenant.cache_salt", "tenant_id": a, "rotated": True}
    assert _cached(server, key_a, PROMPT_A) == 0  # unreachable: device pool and host tier
    assert _cached(server, key_a, PROMPT_A) > 0  # cached anew, under the new salt
    assert _cached(server, key_b, PROMPT_B) > 0  # B's kept

    with server.sessions() as session:
        salts = dict(session.execute(select(Tenant.id, Tenant.cache_salt)).all())
    assert salts[b] is None and len(salts[a]) == 64
    shown = httpx.get(f"{server.url}/admin/api/tenants/{a}", headers=auth(ADMIN_KEY)).text
    assert salts[a] not in shown and "cache_salt" not in shown  # a secret: never shown
    assert _rotate(server, a).status_code == 200
    with server.sessions() as session:
        assert session.get(Tenant, a).cache_salt not in (None, salts[a])


def test_rotation_is_the_admins_and_names_a_tenant(server):
    tenant, key = server.new_tenant("salt-c")
    assert _rotate(server, tenant, key=key).status_code in (401, 403)  # a tenant key
    missing = _rotate(server, 10**6)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "tenant_not_found"


def test_the_cli_rotates_a_salt(tmp_path, monkeypatch, capsys):
    """`loraplex tenants rotate-cache-salt TENANT` (name or id) on the registry directly."""
    import os

    from loraplex.platform.cli import main
    from loraplex.platform.db.session import make_engine, make_sessionmaker

    for var in [v for v in os.environ if v.startswith("LORAPLEX_")]:
        monkeypatch.delenv(var)
    url = f"sqlite:///{tmp_path / 'data' / 'registry.db'}"
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)
    assert main(["db", "upgrade"]) == 0
    assert main(["tenants", "create", "acme"]) == 0
    db = make_engine(url)
    salts = []
    try:
        for ref in ("acme", "1"):
            capsys.readouterr()
            assert main(["tenants", "rotate-cache-salt", ref]) == 0
            assert "tenant acme (id 1): cache salt rotated" in capsys.readouterr().out
            with make_sessionmaker(db)() as session:
                salts.append(session.get(Tenant, 1).cache_salt)
    finally:
        db.dispose()
    assert len(set(salts)) == 2 and all(len(s) == 64 for s in salts)
    assert main(["tenants", "rotate-cache-salt", "nobody"]) == 2
