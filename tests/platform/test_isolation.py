"""Tenant isolation over HTTP: another tenant's adapters are invisible, keys fail when they should,
admin routes refuse tenant keys, and key secrets never reach the database in clear."""

from __future__ import annotations

import re
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import inspect, select, text

from loraplex.platform.db import crud
from loraplex.platform.db.models import ApiKey, utcnow
from loraplex.platform.security import DISPLAY_PREFIX_CHARS, hash_key
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.uploads import auth, complete, folder_parts, upload

NAME = "private-one"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("iso")) as srv:
        yield srv


def _probe(url: str, key: str, name: str) -> dict[str, tuple[int, dict]]:
    """Everything tenant-facing that names an adapter: status and JSON body of each."""
    h = auth(key)
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    responses = {
        "get": httpx.get(f"{url}/v1/adapters/{name}", headers=h),
        "delete": httpx.delete(f"{url}/v1/adapters/{name}", headers=h),
        "completion": complete(url, key, name),
        "stream": complete(url, key, name, stream=True),
        "chat": httpx.post(f"{url}/v1/chat/completions", headers=h, json=chat),
    }
    return {k: (r.status_code, r.json()) for k, r in responses.items()}


def _listed(url: str, key: str) -> tuple[set[str], set[str]]:
    adapters = httpx.get(f"{url}/v1/adapters", headers=auth(key)).json()["data"]
    models = httpx.get(f"{url}/v1/models", headers=auth(key)).json()["data"]
    return {a["name"] for a in adapters}, {m["id"] for m in models}


def test_other_tenant_cannot_see_use_or_delete_an_adapter(server, tiny_adapters):
    _, key_a = server.new_tenant("iso-a")
    _, key_b = server.new_tenant("iso-b")
    # B's view of a name nobody has, before A owns it: the reference answers.
    before = _probe(server.url, key_b, NAME)
    assert before["completion"][0] == 404
    assert before["completion"][1]["error"]["code"] == "model_not_found"
    assert before["get"][0] == before["delete"][0] == 404

    created = upload(server.url, key_a, NAME, folder_parts(tiny_adapters["llama"]["qv4"]))
    assert created.status_code == 201, created.text
    assert NAME in _listed(server.url, key_a)[0] and NAME in _listed(server.url, key_a)[1]

    after = _probe(server.url, key_b, NAME)
    assert after == before  # byte-for-byte the same answers: B cannot tell A's adapter exists
    assert NAME not in _listed(server.url, key_b)[0] | _listed(server.url, key_b)[1]
    # Nor through the engine-side name the server derives from the tenant id.
    assert complete(server.url, key_b, f"1/{NAME}").status_code == 404

    # A's adapter survived B's delete and still works for A.
    ok = complete(server.url, key_a, NAME)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert httpx.get(f"{server.url}/v1/adapters/{NAME}", headers=auth(key_a)).status_code == 200

    # B may take the same name (a 409 would leak that the name is in use elsewhere); the two
    # stay separate adapters with their own weights.
    mine = upload(server.url, key_b, NAME, folder_parts(tiny_adapters["llama"]["attn8"]))
    assert mine.status_code == 201, mine.text
    text_a = complete(server.url, key_a, NAME).json()["choices"][0]["text"]
    text_b = complete(server.url, key_b, NAME).json()["choices"][0]["text"]
    assert text_a == ok.json()["choices"][0]["text"] and text_b != text_a
    assert httpx.delete(f"{server.url}/v1/adapters/{NAME}", headers=auth(key_b)).status_code == 200
    assert complete(server.url, key_a, NAME).json()["choices"][0]["text"] == text_a


def test_reused_row_id_never_serves_another_tenants_weights(server, tiny_adapters):
    """SQLite hands a deleted row's id to the next insert; the engine must not mistake the new
    adapter for the old one it still holds in memory."""
    _, key_a = server.new_tenant("reuse-a")
    _, key_b = server.new_tenant("reuse-b")
    llama = tiny_adapters["llama"]
    assert upload(server.url, key_a, "gone", folder_parts(llama["qv4"])).status_code == 201
    assert complete(server.url, key_a, "gone").status_code == 200  # loaded into the engine
    assert httpx.delete(f"{server.url}/v1/adapters/gone", headers=auth(key_a)).status_code == 200

    assert upload(server.url, key_b, "fresh", folder_parts(llama["mlp16"])).status_code == 201
    got = complete(server.url, key_b, "fresh").json()["choices"][0]["text"]
    # The reference: the same weights under a name uploaded later (a row id never used).
    assert upload(server.url, key_b, "fresh-ref", folder_parts(llama["mlp16"])).status_code == 201
    want = complete(server.url, key_b, "fresh-ref").json()["choices"][0]["text"]
    assert got == want


def _auth_fails(url: str, key: str) -> None:
    for r in (
        httpx.get(f"{url}/v1/models", headers=auth(key)),
        httpx.get(f"{url}/v1/adapters", headers=auth(key)),
        complete(url, key, "llama"),
    ):
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error"


def test_revoked_and_expired_keys_get_401(server):
    tenant_id, good = server.new_tenant("keys")
    with server.sessions() as session:
        expired, _ = crud.create_key(
            session, tenant_id=tenant_id, expires_at=utcnow() - timedelta(seconds=1)
        )
        later, _ = crud.create_key(
            session, tenant_id=tenant_id, expires_at=utcnow() + timedelta(hours=1)
        )
        revoked, row = crud.create_key(session, tenant_id=tenant_id)
    assert httpx.get(f"{server.url}/v1/models", headers=auth(revoked)).status_code == 200
    with server.sessions() as session:
        crud.revoke_key(session, key_id=row.id)

    _auth_fails(server.url, expired)
    _auth_fails(server.url, revoked)
    _auth_fails(server.url, good[:-2])  # a mangled key
    for key in (good, later):  # the tenant's other keys are unaffected
        assert httpx.get(f"{server.url}/v1/models", headers=auth(key)).status_code == 200
    missing = httpx.get(f"{server.url}/v1/models")
    assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]


def test_suspended_tenant_gets_401(server):
    tenant_id, key = server.new_tenant("suspend-me")
    assert complete(server.url, key, "llama").status_code == 200
    with server.sessions() as session:
        crud.update_tenant(session, tenant_id=tenant_id, status="suspended")
    _auth_fails(server.url, key)
    with server.sessions() as session:
        crud.update_tenant(session, tenant_id=tenant_id, status="active")
    assert complete(server.url, key, "llama").status_code == 200


def _admin_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every admin route, path parameters filled with ids nobody has."""
    paths = app.openapi()["paths"]
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "999999", path))
        for path, methods in paths.items()
        if path.startswith("/admin/api")
        for method in methods
    ]


def test_admin_routes_refuse_tenant_keys(server):
    _, key = server.new_tenant("not-admin")
    routes = _admin_routes(server.app)
    assert len(routes) >= 10, "the admin API should expose its routes in the OpenAPI schema"
    for method, path in routes:
        url = f"{server.url}{path}"
        as_tenant = httpx.request(method, url, headers=auth(key), json={})
        assert as_tenant.status_code == 403, (method, path, as_tenant.text)
        assert as_tenant.json()["error"]["type"] == "permission_error"
        assert httpx.request(method, url, json={}).status_code == 401, (method, path)
        if method == "GET":  # the admin key gets past the check (reads only: nothing changes)
            as_admin = httpx.get(url, headers=auth(ADMIN_KEY))
            assert as_admin.status_code not in (401, 403), (path, as_admin.text)
    with server.sessions() as session:  # and nothing the tenant sent took effect
        assert crud.get_tenant_by_name(session, name="not-admin").status == "active"


def test_keys_are_not_stored_in_clear(server):
    tenant_id, secret = server.new_tenant("clear-text")
    assert httpx.get(f"{server.url}/v1/models", headers=auth(secret)).status_code == 200
    with server.sessions() as session:
        more = [crud.create_key(session, tenant_id=tenant_id, name=f"k{i}")[0] for i in range(3)]
        row = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(secret))).one()
        assert row.prefix == secret[:DISPLAY_PREFIX_CHARS]
    secrets = [secret, *more]
    # The part of each secret that is never displayed must appear nowhere.
    hidden = [s[DISPLAY_PREFIX_CHARS:] for s in secrets] + [ADMIN_KEY]

    db_path = server.settings.database_url.removeprefix("sqlite:///")
    files = [p for p in server.settings.data_dir.rglob("*") if p.name.startswith("loraplex.db")]
    assert any(str(p) == db_path for p in files)
    for path in files:  # the database file and its WAL/shm companions, raw bytes
        raw = path.read_bytes()
        for h in hidden:
            assert h.encode() not in raw, f"{path.name} holds a key secret in clear"

    with server.sessions() as session:
        bind = session.get_bind()
        for table in inspect(bind).get_table_names():
            for values in session.execute(text(f'SELECT * FROM "{table}"')):
                cells = " ".join(str(v) for v in values)
                assert not any(h in cells for h in hidden), f"{table} holds a key secret"
