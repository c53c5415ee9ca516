"""Two `loraplex serve` processes on one PostgreSQL database and one S3 store (moto's server),
driven by a hypothesis state machine through their HTTP APIs, as tenants and the admin would.

Rules: batches of concurrent uploads and deletes spread over both replicas (the same or
different bytes, names and tenants), completions on either replica, suspend / reactivate a
tenant, revoke a key and issue a new one, the collector. After every step:

- the batch's answers and the registry are those of some order of its operations (checked
  against a model of the registry: linearizable);
- both replicas list each tenant's adapters as the model says, with every version's digest
  (an upload under a taken name is its next version), and never another tenant's;
- every listed version's object is in the store, and every adapter serves, on both replicas,
  the text of the version its default alias names (each content's greedy text is learned once
  and must not change);
- a suspended tenant or a revoked key is refused on both replicas;
- the usage ledger holds exactly the requests and tokens clients received;
- after the collector, no stored object is left that no adapter names.

The interleavings here are the real ones (threads against two processes); the in-process
machine in test_adapter_races.py chooses them.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
from types import SimpleNamespace

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import select

from loraplex.platform import adapter_service
from loraplex.platform.db import crud
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.store import adapter_digest
from tests.utils.fleet import complete, new_tenant, received_usage
from tests.utils.registry_model import linearize
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import auth, folder_parts, upload

EXAMPLES = int(os.environ.get("LORAPLEX_RACE_EXAMPLES", "3"))
TENANTS = (0, 1)
NAMES = ("d", "e")
CONTENTS = ("x", "y")


_OUTCOMES = {201: "created", 200: "deleted", 404: "missing", 401: "refused"}


class FleetRaces(RuleBasedStateMachine):
    fleet: SimpleNamespace  # set by the test

    @initialize()
    def setup(self):
        f = self.fleet
        self.urls = (f.a, f.b)
        self.tenants = []
        for _ in TENANTS:
            tid, key_id, key = new_tenant(f.a, f"races-{secrets.token_hex(4)}")
            self.tenants.append(SimpleNamespace(id=tid, key_id=key_id, key=key, old_keys=[]))
        self.active = {t: True for t in TENANTS}
        self.model: dict = {}  # tests/utils/registry_model.py
        self.received: dict[str, tuple[int, int]] = {}  # request id -> (prompt, completion)

    # --- rules ------------------------------------------------------------------------------

    def _op(self, op: tuple, replica: int) -> str:
        kind, tenant, name, *rest = op
        url, key = self.urls[replica], self.tenants[tenant].key
        if kind == "upload":
            r = upload(url, key, name, folder_parts(self.fleet.folders[rest[0]]))
        else:
            r = httpx.delete(f"{url}/v1/adapters/{name}", headers=auth(key), timeout=60)
        assert r.status_code in _OUTCOMES, (op, r.status_code, r.text)
        return _OUTCOMES[r.status_code]

    ops = st.one_of(
        st.tuples(st.just("upload"), st.sampled_from(TENANTS), st.sampled_from(NAMES),
                  st.sampled_from(CONTENTS)),
        st.tuples(st.just("delete"), st.sampled_from(TENANTS), st.sampled_from(NAMES)),
    )  # fmt: skip

    @rule(batch=st.lists(st.tuples(ops, st.integers(0, 1)), min_size=2, max_size=3))
    def concurrently(self, batch):
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda job: self._op(*job), batch))
        ops = [op for op, _ in batch]
        after = linearize(self.model, ops, got, self._listed(0), self._as_listed, self.active.get)
        assert after is not None, f"{batch} answered {got}: no order explains it"
        self.model = after

    @precondition(lambda self: getattr(self, "model", None))
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), name=st.sampled_from(NAMES),
          replica=st.integers(0, 1))  # fmt: skip
    def delete_while_the_same_bytes_are_uploaded(self, data, tenant, name, replica):
        """The race that once lost adapters: an adapter deleted on one replica while the same
        bytes are uploaded (by its owner or another tenant) on the other."""
        (owner, gone), entry = data.draw(st.sampled_from(sorted(self.model.items())))
        content = dict(entry.versions)[entry.default]
        self.concurrently([(("delete", owner, gone), replica),
                           (("upload", tenant, name, content), 1 - replica)])  # fmt: skip
        self.serve(tenant, replica)  # the stored object must still be there to fetch

    @rule(tenant=st.sampled_from(TENANTS), replica=st.integers(0, 1))
    def serve(self, tenant, replica):
        """Every adapter the model says the tenant has answers with its own weights' text."""
        t = self.tenants[tenant]
        for (owner, name), entry in sorted(self.model.items()):
            if owner != tenant:
                continue
            content = dict(entry.versions)[entry.default]  # what the name's requests get
            r = complete(self.urls[replica], t.key, name, max_tokens=4)
            if not self.active[tenant]:
                assert r.status_code == 401, r.text
                continue
            assert r.status_code == 200, (name, content, r.text)
            rid, p, c = received_usage(r)
            self.received[rid] = (p, c)
            text = r.json()["choices"][0]["text"]
            assert self.fleet.texts.setdefault(content, text) == text, (name, content)

    @rule(tenant=st.sampled_from(TENANTS), active=st.booleans())
    def set_status(self, tenant, active):
        r = httpx.patch(f"{self.fleet.a}/admin/api/tenants/{self.tenants[tenant].id}",
                        headers=auth(ADMIN_KEY),
                        json={"status": "active" if active else "suspended"})  # fmt: skip
        assert r.status_code == 200, r.text
        self.active[tenant] = active

    @rule(tenant=st.sampled_from(TENANTS), replica=st.integers(0, 1))
    def rekey(self, tenant, replica):
        t, url, admin = self.tenants[tenant], self.urls[replica], auth(ADMIN_KEY)
        assert httpx.post(f"{url}/admin/api/keys/{t.key_id}/revoke", headers=admin).is_success
        r = httpx.post(f"{url}/admin/api/tenants/{t.id}/keys", headers=admin, timeout=30)
        assert r.status_code == 201, r.text
        t.old_keys.append(t.key)
        t.key_id, t.key = r.json()["id"], r.json()["secret"]

    @precondition(lambda self: hasattr(self, "model"))
    @rule()
    def collect(self):
        state = SimpleNamespace(store=self.fleet.store, sessions=self.fleet.sessions)
        adapter_service.collect_unreferenced(state, grace_s=0)  # nothing is in flight now
        with self.fleet.sessions() as session:
            named = crud.storage_keys(session)
        assert {o.key for o in self.fleet.store.list_objects()} == named

    # --- invariants -------------------------------------------------------------------------

    def _listed(self, replica: int) -> dict[tuple[int, str], dict[int, str]]:
        """(tenant, name) -> {version: sha256} as the tenants' own listings show, through the
        admin API (a suspended tenant cannot list its own)."""
        r = httpx.get(f"{self.urls[replica]}/admin/api/adapters", headers=auth(ADMIN_KEY),
                      timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        ids = {t.id: i for i, t in enumerate(self.tenants)}
        out: dict = {}
        for a in r.json()["data"]:
            if a["tenant_id"] in ids:
                out.setdefault((ids[a["tenant_id"]], a["name"]), {})[a["version"]] = a["sha256"]
        return out

    def _as_listed(self, model) -> dict[tuple[int, str], dict[int, str]]:
        return {k: {v: self.fleet.digests[c] for v, c in e.versions} for k, e in model.items()}

    @invariant()
    def both_replicas_list_what_the_model_holds(self):
        if not hasattr(self, "model"):
            return
        want = self._as_listed(self.model)
        for replica in (0, 1):
            assert self._listed(replica) == want
            for i, t in enumerate(self.tenants):  # a tenant's own view: its adapters only
                if not self.active[i]:
                    continue
                r = httpx.get(f"{self.urls[replica]}/v1/adapters", headers=auth(t.key))
                assert r.status_code == 200, r.text
                mine = {(i, a["name"]): {v["version"]: v["sha256"] for v in a["versions"]}
                        for a in r.json()["data"]}  # fmt: skip
                assert mine == {k: v for k, v in want.items() if k[0] == i}

    @invariant()
    def every_adapter_has_its_object(self):
        """What serving fetches on a replica whose disk cache does not hold it yet."""
        with self.fleet.sessions() as session:
            keys = {(a.tenant_id, a.name, a.version): a.storage_key
                    for a in crud.list_adapters(session, tenant_id=None)}  # fmt: skip
        ids = {t.id for t in self.tenants}
        lost = [k for k, key in keys.items() if k[0] in ids and not self.fleet.store.exists(key)]
        assert not lost, f"adapters whose stored object is gone: {lost}"

    @invariant()
    def old_keys_are_refused_everywhere(self):
        if not hasattr(self, "model"):
            return
        for t in self.tenants:
            for key in t.old_keys[-1:]:
                for url in self.urls:
                    r = httpx.get(f"{url}/v1/models", headers=auth(key), timeout=30)
                    assert r.status_code == 401, r.text

    @invariant()
    def the_ledger_equals_what_clients_received(self):
        if not hasattr(self, "model"):
            return
        ids = [t.id for t in self.tenants]
        with self.fleet.sessions() as session:
            rows = session.execute(
                select(UsageRecord.request_id, UsageRecord.prompt_tokens,
                       UsageRecord.completion_tokens).where(UsageRecord.tenant_id.in_(ids))
            ).all()  # fmt: skip
        assert {rid: (p, c) for rid, p, c in rows} == self.received


def test_two_replicas_keep_registry_store_and_ledger_consistent(replicas):
    a, b, sessions, folders, store = replicas
    fleet = SimpleNamespace(
        a=a, b=b, sessions=sessions, store=store, folders=folders, texts={},
        digests={name: adapter_digest(folder) for name, folder in folders.items()},
    )  # fmt: skip
    machine = type("Machine", (FleetRaces,), {"fleet": fleet})
    limits = settings(max_examples=EXAMPLES, stateful_step_count=8, deadline=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
    run_state_machine_as_test(machine, settings=limits)
    assert len(set(fleet.texts.values())) == len(fleet.texts)  # the two weights answer apart
