"""The registry and the store stay consistent under any interleaving of uploads, in-place
updates, deletes, promotions and version deletes.

A hypothesis state machine drives `adapter_service` (what every upload and delete route calls)
over a real database (SQLite and PostgreSQL) and a real store (a folder and moto's S3 server).
Rules upload (a new version), publish in place, delete a name, promote a version and delete a
version — the same or different bytes, names and tenants — one at a time or two
at once, the two as two replicas would (each with its own database pool and store client on the
one registry and store), and for two at once hypothesis also draws who moves next at every store
call (tests/utils/interleave.py). After each step:

- the outcome is linearizable: the two operations' answers and the registry equal those of
  running them one after the other in some order (a model of the registry says what that gives);
- every registered version's object is in the store and holds the bytes uploaded as that
  version (what serving fetches), and each name's default alias points at a live version;
- once the collector has run, no object is left that no adapter names.

On the code before per-put keys this finds the lost-adapter race (tenant X deletes while
tenant Y uploads the same bytes: Y's row names an object X's delete removed) within a few
dozen examples; `LORAPLEX_RACE_EXAMPLES=2000 pytest tests/platform/test_adapter_races.py` is
the long run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from loraplex.platform import adapter_service
from loraplex.platform.adapter_service import store_for
from loraplex.platform.cli import main
from loraplex.platform.db import crud
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.settings import Settings
from loraplex.platform.store import AdapterNotFound, LocalStore, adapter_digest, make_store
from tests.platform.conftest import _empty_pg_schema
from tests.platform.test_store import fake_adapter
from tests.utils.interleave import GatedStore, Interleaver
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, moto_server
from tests.utils.registry_model import apply, linearize

EXAMPLES = int(os.environ.get("LORAPLEX_RACE_EXAMPLES", "25"))
TENANTS = ("x", "y")
NAMES = ("d", "e")
CONTENTS = 2  # distinct adapters: few, so that rows with the same bytes are common


@pytest.fixture(scope="module")
def s3_url():
    with moto_server() as url:
        yield url


def _registry_and_store(db: str, store_kind: str, work: Path, pg_url, s3_url):
    """The database URL, and a function making a store client on one shared store."""
    if db == "sqlite":
        url = f"sqlite:///{work / 'registry.db'}"
    else:
        _empty_pg_schema(pg_url)
        url = pg_url
    upgrade(url)
    if store_kind == "local":
        return url, lambda: LocalStore(work / "store")
    bucket = f"races-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                 aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=bucket)  # fmt: skip
    return url, lambda: make_store(f"s3://{bucket}/a", endpoint_url=s3_url, region=REGION,
                                   access_key=ACCESS_KEY, secret_key=SECRET_KEY)  # fmt: skip


def _info(folder: Path):
    return SimpleNamespace(rank=4, alpha=8.0, targets=("q_proj",), nbytes=100,
                           digest=adapter_digest(folder))  # fmt: skip


class AdapterRaces(RuleBasedStateMachine):
    """`case` (db, store) and the fixtures' values are set by the test that runs it."""

    case: tuple[str, str]
    pg_url: str | None = None
    s3_url: str | None = None

    @initialize()
    def setup(self):
        self.work = Path(tempfile.mkdtemp(prefix="races-"))
        url, new_store = _registry_and_store(*self.case, self.work, self.pg_url, self.s3_url)
        self.interleaver: Interleaver | None = None
        # Two servers' worth of state: their own database pools and store clients on the one
        # registry and store, as replicas have.
        self.dbs = [make_engine(url), make_engine(url)]
        self.replicas = [
            SimpleNamespace(sessions=make_sessionmaker(db), model_name="base",
                            store=GatedStore(new_store(), lambda: self.interleaver),
                            settings=SimpleNamespace(data_plane="embedded"))
            for db in self.dbs
        ]  # fmt: skip
        self.state = self.replicas[0]
        self.folders = [fake_adapter(self.work / f"src{i}", seed=i) for i in range(CONTENTS)]
        self.digests = [adapter_digest(f) for f in self.folders]
        with self.state.sessions() as session:
            self.tenant_ids = {t: crud.create_tenant(session, name=t).id for t in TENANTS}
        self.model: dict[tuple[str, str], int] = {}  # (tenant, name) -> content index

    def teardown(self):
        for db in self.dbs:
            db.dispose()
        shutil.rmtree(self.work, ignore_errors=True)

    # --- operations, as the routes call them -----------------------------------------------

    def _run(self, op: tuple, replica: int = 0):
        kind, tenant, name, *rest = op
        tid, state = self.tenant_ids[tenant], self.replicas[replica]
        if kind in ("upload", "publish"):
            folder = self.folders[rest[0]]
            if kind == "publish":  # no collection: its own step is not one atomic change
                adapter_service.publish_version(state, tid, name, folder, _info(folder), keep=99)
            else:
                adapter_service.store_and_register(state, tid, name, folder, _info(folder))
            return "created"
        with state.sessions() as session:
            if kind == "delete":
                gone = adapter_service.remove_adapter(state, session, tenant_id=tid, name=name)
                return "deleted" if gone else "missing"
            if kind == "promote":
                try:
                    crud.set_alias(session, tenant_id=tid, name=name, alias="default",
                                   weights={rest[0]: 100})  # fmt: skip
                except crud.NotFound:
                    return "missing"
                return "promoted"
            try:
                gone = adapter_service.remove_version(
                    state, session, tenant_id=tid, name=name, version=rest[0]
                )
            except crud.InUse:
                return "in_use"
            return "dropped" if gone else "missing"

    ops = st.one_of(
        st.tuples(st.sampled_from(("upload", "publish")), st.sampled_from(TENANTS),
                  st.sampled_from(NAMES), st.integers(0, CONTENTS - 1)),
        st.tuples(st.just("delete"), st.sampled_from(TENANTS), st.sampled_from(NAMES)),
        st.tuples(st.sampled_from(("promote", "drop")), st.sampled_from(TENANTS),
                  st.sampled_from(NAMES), st.integers(1, 3)),
    )  # fmt: skip

    @rule(op=ops)
    def alone(self, op):
        outcome, self.model = apply(self.model, op)
        assert self._run(op) == outcome

    @rule(a=ops, b=ops, schedule=st.lists(st.integers(0, 1), max_size=12))
    def together(self, a, b, schedule):
        self.interleaver = Interleaver(schedule)
        try:
            got = self.interleaver.run([lambda: self._run(a, 0), lambda: self._run(b, 1)])
        finally:
            trace, self.interleaver = self.interleaver.trace, None
        for r in got:
            if isinstance(r, BaseException):
                raise AssertionError(f"{a} with {b} raised (store calls {trace})") from r
        after = linearize(self.model, (a, b), got, self._registry(), self._view)
        assert after is not None, f"{a} with {b} answered {got}: no order explains it ({trace})"
        self.model = after

    def _view(self, model) -> dict:
        """(tenant, name) -> (default version, {version: digest}), as `_registry` reads it."""
        return {k: (e.default, {v: self.digests[c] for v, c in e.versions})
                for k, e in model.items()}  # fmt: skip

    @rule()
    def collect(self):
        adapter_service.collect_unreferenced(self.state, grace_s=0)
        named = {key for *_, key, _ in self._rows_full()}
        assert {o.key for o in self.state.store.list_objects()} == named

    # --- invariants ------------------------------------------------------------------------

    def _rows_full(self):
        """(tenant, name, version, storage key, digest) of every live version."""
        names = {v: k for k, v in self.tenant_ids.items()}
        with self.state.sessions() as session:
            rows = crud.list_adapters(session, tenant_id=None)
            return [(names[r.tenant_id], r.name, r.version, r.storage_key, r.sha256)
                    for r in rows]  # fmt: skip

    def _registry(self) -> dict:
        names = {v: k for k, v in self.tenant_ids.items()}
        with self.state.sessions() as session:
            defaults = {
                (names[a.tenant_id], a.name): [int(v) for v in a.weights]
                for a in crud.list_aliases(session, tenant_id=None)
                if a.alias == "default"
            }
        out: dict = {}
        for tenant, name, version, _, digest in self._rows_full():
            out.setdefault((tenant, name), ({}))[version] = digest
        assert set(defaults) == set(out), "a name without a default alias, or the reverse"
        for key, versions in out.items():
            [default] = defaults[key]  # one version: the machine never splits
            assert default in versions, f"{key}'s default alias points at a gone version"
        return {key: (defaults[key][0], versions) for key, versions in out.items()}

    @invariant()
    def every_adapter_serves_its_own_bytes(self):
        if not hasattr(self, "model"):
            return
        assert self._registry() == self._view(self.model)
        for tenant, name, version, key, digest in self._rows_full():
            dest = self.work / "fetched" / secrets.token_hex(4)
            try:
                self.state.store.fetch(key, dest)
            except AdapterNotFound:
                raise AssertionError(f"{tenant}'s {name}@v{version} lost its object") from None
            assert adapter_digest(dest) == digest
            shutil.rmtree(dest)


@pytest.mark.parametrize(
    "case", [("sqlite", "local"), ("postgresql", "s3")], ids=["sqlite-local", "postgresql-s3"]
)
def test_no_interleaving_loses_an_adapter(case, request):
    machine = type("Machine", (AdapterRaces,), {"case": case})
    if case[0] == "postgresql":
        machine.pg_url = request.getfixturevalue("pg_database_url")
        machine.s3_url = request.getfixturevalue("s3_url")
    limits = settings(
        max_examples=EXAMPLES if case[0] == "sqlite" else max(EXAMPLES // 3, 5),
        stateful_step_count=8,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    run_state_machine_as_test(machine, settings=limits)


def test_the_collector_removes_only_what_a_crash_left(tmp_path, monkeypatch, capsys):
    """A put whose row was never written, and an object whose row went before it did, are
    removed by `loraplex adapters gc` once past the grace period; a live adapter never is."""
    for var in [v for v in os.environ if v.startswith("LORAPLEX_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    settings = Settings()
    upgrade(settings.database_url)
    db = make_engine(settings.database_url)
    state = SimpleNamespace(sessions=make_sessionmaker(db), store=store_for(settings),
                            model_name="base", settings=settings)  # fmt: skip
    with state.sessions() as session:
        tid = crud.create_tenant(session, name="acme").id
    live, gone, crashed = (fake_adapter(tmp_path / f"src{i}", seed=i) for i in range(3))
    row = adapter_service.store_and_register(state, tid, "live", live, _info(live))
    adapter_service.store_and_register(state, tid, "gone", gone, _info(gone))
    with state.sessions() as session:  # the row went, then the process died
        [gone_row] = crud.delete_adapter(session, tenant_id=tid, name="gone")
        gone_key = gone_row.storage_key
    crashed_key = state.store.put(crashed, adapter_digest(crashed))  # died before its row
    db.dispose()

    young = adapter_service.collect_unreferenced(state, grace_s=3600)
    assert (young.removed, young.kept_young, young.referenced) == ([], 2, 1)
    assert main(["adapters", "gc", "--grace-s", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["removed"]) == sorted([gone_key, crashed_key])
    assert [o.key for o in state.store.list_objects()] == [row.storage_key]
    assert adapter_digest(state.store.fetch(row.storage_key, tmp_path / "out")) == row.sha256
