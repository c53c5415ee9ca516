"""Registry CRUD: tenants, quotas, keys (stored hashed) and adapters (isolated per tenant)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from loraplex.platform.db import crud
from loraplex.platform.db.models import Base

NOW = datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)
SHA = "ab" * 32


def _adapter(session, tenant_id, name="pirate", **overrides):
    fields = dict(
        base_model="demo", rank=8, alpha=16.0, targets=["q_proj", "v_proj"], bytes=1000,
        sha256=SHA, storage_key=f"adapters/{SHA}",
    )  # fmt: skip
    return crud.create_adapter(session, tenant_id=tenant_id, name=name, **(fields | overrides))


def test_tenant_create_get_update_list(session, tenant):
    assert tenant.status == "active" and tenant.weight == 1.0
    # Prices come back exactly, as Decimals, on both backends.
    fetched = crud.get_tenant(session, tenant_id=tenant.id)
    assert fetched.price_prompt_per_1k == Decimal("0.0015")
    assert crud.get_tenant_by_name(session, name="acme").id == tenant.id

    crud.update_tenant(
        session, tenant_id=tenant.id, weight=2.5, price_completion_per_1k="0.000020001"
    )
    session.expire_all()
    fetched = crud.get_tenant(session, tenant_id=tenant.id)
    assert fetched.weight == 2.5
    assert fetched.price_completion_per_1k == Decimal("0.000020001")
    assert fetched.price_prompt_per_1k == Decimal("0.0015")  # untouched

    crud.create_tenant(session, name="beta")
    crud.update_tenant(session, tenant_id=tenant.id, status="suspended")
    assert [t.name for t in crud.list_tenants(session)] == ["acme", "beta"]
    assert [t.name for t in crud.list_tenants(session, status="active")] == ["beta"]


def test_tenant_input_errors_say_what_is_wrong(session, tenant):
    with pytest.raises(crud.Conflict, match="'acme' already exists"):
        crud.create_tenant(session, name="acme")
    with pytest.raises(ValueError, match="weight"):
        crud.create_tenant(session, name="zero", weight=0)
    with pytest.raises(ValueError, match="name"):
        crud.create_tenant(session, name="has space")
    with pytest.raises(ValueError, match="price_prompt_per_1k"):
        crud.create_tenant(session, name="cheap", price_prompt_per_1k="free")
    with pytest.raises(ValueError, match="price_completion_per_1k"):
        crud.create_tenant(session, name="cheap", price_completion_per_1k="-1")
    with pytest.raises(ValueError, match="status"):
        crud.update_tenant(session, tenant_id=tenant.id, status="deleted")
    with pytest.raises(crud.NotFound):
        crud.update_tenant(session, tenant_id=tenant.id + 100, weight=2)
    # The failed insert rolled back cleanly: the session is still usable.
    assert crud.get_tenant_by_name(session, name="acme") is not None


def test_quota_set_replaces_all_limits(session, tenant):
    assert crud.get_quota(session, tenant_id=tenant.id) is None  # unlimited
    crud.set_quota(session, tenant_id=tenant.id, requests_per_min=10, max_rank=16)
    quota = crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=10**12)
    assert (quota.requests_per_min, quota.max_rank, quota.tokens_per_month) == (None, None, 10**12)
    with pytest.raises(ValueError, match="requests_per_min"):
        crud.set_quota(session, tenant_id=tenant.id, requests_per_min=-1)


def test_keys_are_stored_only_as_hashes(session, tenant):
    secret, key = crud.create_key(session, tenant_id=tenant.id, name="ci")
    assert secret.startswith("lpx_") and len(secret) == 4 + 43
    assert key.prefix == secret[:12]
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()

    # Nowhere in the database, in any column of any table.
    session.expire_all()
    for table in Base.metadata.sorted_tables:
        for row in session.execute(select(table)):
            assert all(secret not in str(value) for value in row)
            assert all(secret[len("lpx_") :] not in str(value) for value in row)

    (listed,) = crud.list_keys(session, tenant_id=tenant.id)
    assert listed.prefix == key.prefix and "key_hash" not in listed.model_dump()


def test_authenticate_accepts_only_live_keys_of_active_tenants(session, tenant):
    secret, key = crud.create_key(session, tenant_id=tenant.id)
    found = crud.authenticate(session, secret, now=NOW)
    assert found is not None and found[0].id == tenant.id and found[1].id == key.id

    assert crud.authenticate(session, "lpx_" + "x" * 43, now=NOW) is None  # unknown
    assert crud.authenticate(session, secret[:-1], now=NOW) is None  # truncated
    assert crud.authenticate(session, "", now=NOW) is None

    crud.update_tenant(session, tenant_id=tenant.id, status="suspended")
    assert crud.authenticate(session, secret, now=NOW) is None
    crud.update_tenant(session, tenant_id=tenant.id, status="active")
    assert crud.authenticate(session, secret, now=NOW) is not None

    crud.revoke_key(session, key_id=key.id, now=NOW)
    assert crud.authenticate(session, secret, now=NOW) is None


def test_expired_key_fails_from_its_expiry_on(session, tenant):
    secret, _ = crud.create_key(session, tenant_id=tenant.id, expires_at=NOW + timedelta(hours=1))
    assert crud.authenticate(session, secret, now=NOW + timedelta(minutes=59)) is not None
    assert crud.authenticate(session, secret, now=NOW + timedelta(hours=1)) is None


def test_last_used_at_is_written_at_most_once_a_minute(session, tenant):
    secret, key = crud.create_key(session, tenant_id=tenant.id)
    crud.authenticate(session, secret, now=NOW)
    crud.authenticate(session, secret, now=NOW + timedelta(seconds=30))
    session.expire_all()
    assert crud.list_keys(session, tenant_id=tenant.id)[0].last_used_at == NOW
    crud.authenticate(session, secret, now=NOW + timedelta(seconds=61))
    session.expire_all()
    assert crud.list_keys(session, tenant_id=tenant.id)[0].last_used_at == NOW + timedelta(
        seconds=61
    )


def test_a_tenant_cannot_revoke_another_tenants_key(session, tenant):
    other = crud.create_tenant(session, name="other")
    secret, key = crud.create_key(session, tenant_id=tenant.id)
    with pytest.raises(crud.NotFound):
        crud.revoke_key(session, key_id=key.id, tenant_id=other.id)
    assert crud.authenticate(session, secret) is not None


def test_a_taken_name_gets_the_next_version_and_aliases_move_atomically(session, tenant):
    other = crud.create_tenant(session, name="other")
    first = _adapter(session, tenant.id, targets="q_proj, v_proj")
    assert first.targets == ["q_proj", "v_proj"] and first.status == "ready"
    assert first.version == 1
    assert _adapter(session, tenant.id, rank=4).version == 2
    with pytest.raises(crud.Conflict, match="already has a version 2"):
        _adapter(session, tenant.id, version=2)
    assert _adapter(session, other.id).version == 1  # the same name in another tenant
    # The conflict left no row behind; the first version holds the default alias.
    assert [a.rank for a in crud.list_adapters(session, tenant_id=tenant.id)] == [8, 4]
    alias = crud.get_alias(session, tenant_id=tenant.id, name="pirate", alias="default")
    assert alias.weights == {"1": 100}
    assert crud.get_adapter(session, tenant_id=tenant.id, name="pirate").version == 2  # newest

    third = _adapter(session, tenant.id, promote=True)
    session.expire_all()
    alias = crud.get_alias(session, tenant_id=tenant.id, name="pirate", alias="default")
    assert (alias.weights, alias.previous) == ({"3": 100}, {"1": 100})
    crud.set_alias(session, tenant_id=tenant.id, name="pirate", alias="default",
                   weights={1: 90, third.version: 10})  # fmt: skip
    with pytest.raises(crud.InUse, match="alias default"):
        crud.delete_adapter_version(session, tenant_id=tenant.id, name="pirate", version=3)
    with pytest.raises(crud.NotFound, match="v9"):
        crud.set_alias(session, tenant_id=tenant.id, name="pirate", alias="x", weights={9: 1})
    rolled = crud.rollback_alias(session, tenant_id=tenant.id, name="pirate", alias="default")
    assert (rolled.weights, rolled.previous) == ({"3": 100}, {"1": 90, "3": 10})
    assert crud.old_versions(session, tenant_id=tenant.id, name="pirate", keep=1) == [2, 1]
    crud.delete_adapter_version(session, tenant_id=tenant.id, name="pirate", version=2)
    with pytest.raises(crud.NotFound, match="deleted"):  # v1 is gone from `previous` next
        crud.delete_adapter_version(session, tenant_id=tenant.id, name="pirate", version=1)
        crud.rollback_alias(session, tenant_id=tenant.id, name="pirate", alias="default")
    removed = crud.delete_adapter(session, tenant_id=tenant.id, name="pirate")
    assert [r.version for r in removed if r.storage_key] == [3]  # 1 and 2 are tombstones
    assert crud.list_aliases(session, tenant_id=tenant.id) == []
    assert _adapter(session, tenant.id).version == 1  # a new name starts again


def test_adapters_are_invisible_across_tenants(session, tenant):
    other = crud.create_tenant(session, name="other")
    _adapter(session, tenant.id, name="secret-sauce")
    assert crud.get_adapter(session, tenant_id=other.id, name="secret-sauce") is None
    assert crud.list_adapters(session, tenant_id=other.id) == []
    with pytest.raises(crud.NotFound):
        crud.delete_adapter(session, tenant_id=other.id, name="secret-sauce")
    with pytest.raises(crud.NotFound):
        crud.mark_adapter_deleted(session, tenant_id=other.id, name="secret-sauce")
    assert crud.get_adapter(session, tenant_id=tenant.id, name="secret-sauce") is not None
    # The admin view (tenant_id=None) sees everyone's.
    _adapter(session, other.id, name="b")
    assert len(crud.list_adapters(session, tenant_id=None)) == 2


def test_adapter_lifecycle_and_totals(session, tenant):
    _adapter(session, tenant.id, name="a", bytes=100)
    _adapter(session, tenant.id, name="b", bytes=50, sha256="cd" * 32,
             storage_key=f"adapters/{'cd' * 32}")  # fmt: skip
    assert crud.adapter_totals(session, tenant_id=tenant.id) == (2, 150)
    key = f"adapters/{SHA}"
    assert crud.count_adapters_with_storage_key(session, storage_key=key) == 1
    assert crud.storage_keys(session) == {key, f"adapters/{'cd' * 32}"}

    crud.mark_adapter_deleted(session, tenant_id=tenant.id, name="a")
    assert crud.get_adapter(session, tenant_id=tenant.id, name="a") is None
    assert [a.name for a in crud.list_adapters(session, tenant_id=tenant.id)] == ["b"]
    assert crud.adapter_totals(session, tenant_id=tenant.id) == (1, 50)

    [removed] = crud.delete_adapter(session, tenant_id=tenant.id, name="a")
    assert removed.storage_key == f"adapters/{SHA}"  # what the caller must clean up
    assert crud.count_adapters_with_storage_key(session, storage_key=key) == 0
    with pytest.raises(crud.NotFound):  # a second delete (a racing one) finds nothing
        crud.delete_adapter(session, tenant_id=tenant.id, name="a")
    _adapter(session, tenant.id, name="a")  # the name is free again


def test_adapter_input_errors(session, tenant):
    with pytest.raises(crud.NotFound):
        _adapter(session, tenant.id + 100)
    with pytest.raises(ValueError, match="sha256"):
        _adapter(session, tenant.id, sha256="not-hex")
    with pytest.raises(ValueError, match="rank"):
        _adapter(session, tenant.id, rank=0)
    with pytest.raises(ValueError, match="name"):
        _adapter(session, tenant.id, name="../escape")


def test_touch_adapter_used_writes_at_most_once_a_minute(session, tenant):
    adapter = _adapter(session, tenant.id)
    crud.touch_adapter_used(session, adapter_id=adapter.id, now=NOW)
    crud.touch_adapter_used(session, adapter_id=adapter.id, now=NOW + timedelta(seconds=10))
    session.expire_all()
    assert crud.get_adapter(session, tenant_id=tenant.id, name="pirate").last_used_at == NOW
    crud.touch_adapter_used(session, adapter_id=adapter.id, now=NOW + timedelta(minutes=2))
    session.expire_all()
    got = crud.get_adapter(session, tenant_id=tenant.id, name="pirate").last_used_at
    assert got == NOW + timedelta(minutes=2)


def test_a_delete_waits_for_an_upload_of_the_same_name_and_removes_its_version(engine, tenant):
    """An upload of a new version and a delete of the name, at once (found by
    tests/platform/test_replica_races.py): the delete must come after the upload, removing
    both versions and the alias, or before it, leaving the new upload as version 1. Before,
    the delete read the name's rows without the version lock, waited only to delete the ones
    it had read, and left the upload's version 2 behind without a default alias: listed, but
    served by no name. Here the delete starts while the upload holds the lock (PostgreSQL
    shows the delete's backend waiting) and must take the upload's version with it."""
    import threading
    import time

    from sqlalchemy import text

    from loraplex.platform.db.models import Adapter, AdapterAlias
    from loraplex.platform.db.session import make_sessionmaker

    sessions = make_sessionmaker(engine)
    with sessions() as s:
        _adapter(s, tenant.id, name="d")
    upload = sessions()
    crud._lock_versions(upload, tenant.id, "d")  # as create_adapter does, up to its commit
    upload.add(Adapter(tenant_id=tenant.id, name="d", version=2, base_model="demo", rank=8,
                       alpha=16.0, targets=["q_proj"], bytes=1000, sha256=SHA,
                       storage_key="adapters/v2"))  # fmt: skip
    upload.flush()
    deleted: list = []

    def delete() -> None:
        with sessions() as s:
            deleted.extend(r.version for r in crud.delete_adapter(s, tenant_id=tenant.id,
                                                                  name="d"))  # fmt: skip

    worker = threading.Thread(target=delete)
    worker.start()
    if engine.dialect.name == "postgresql":  # the delete is blocked on the upload's locks
        deadline = time.monotonic() + 10
        with engine.connect() as c:
            while not c.execute(text("SELECT count(*) FROM pg_stat_activity WHERE "
                                     "wait_event_type = 'Lock' AND datname = current_database()")
                                ).scalar():  # fmt: skip
                assert time.monotonic() < deadline, "the delete never waited for the upload"
                time.sleep(0.02)
    else:
        time.sleep(0.5)  # SQLite: the delete waits for the database's write lock
    upload.commit()
    upload.close()
    worker.join(30)
    with sessions() as s:
        left = s.scalars(select(Adapter).where(Adapter.name == "d")).all()
        aliases = s.scalars(select(AdapterAlias).where(AdapterAlias.name == "d")).all()
    assert sorted(deleted) == [1, 2] and left == [] and aliases == []
