"""The replica heartbeat's rows (platform/replicas.py) on SQLite and PostgreSQL: one row per
replica however often it beats, stale after missed beats, deleted on shutdown or, for a
replica that crashed, by a peer's beat."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timedelta
from types import SimpleNamespace

import hypothesis
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import delete

from loraplex.platform import replicas
from loraplex.platform.db.models import Replica, utcnow
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.main import create_app
from loraplex.platform.settings import Settings
from tests.utils.server import ADMIN_KEY


def test_beats_upsert_mark_stale_and_clean_up(session):
    t0 = utcnow()
    replicas.beat(session, "a:1:1", {"running": 1}, started_at=t0, now=t0)
    replicas.beat(session, "b:2:2", {"running": 0}, started_at=t0, now=t0)
    later = t0 + timedelta(seconds=20)
    replicas.beat(session, "a:1:1", {"running": 3}, started_at=later, now=later)  # an upsert

    rows = {r["id"]: r for r in replicas.fleet(session, stale_after_s=15, now=later)}
    assert set(rows) == {"a:1:1", "b:2:2"}
    assert rows["a:1:1"]["state"] == {"running": 3}
    assert rows["a:1:1"]["started_at"] == t0  # kept from the first beat
    assert (rows["a:1:1"]["stale"], rows["a:1:1"]["seen_s_ago"]) == (False, 0.0)
    assert (rows["b:2:2"]["stale"], rows["b:2:2"]["seen_s_ago"]) == (True, 20.0)

    gone = t0 + timedelta(seconds=replicas.GONE_S + 1)  # b crashed long ago: a's beat drops it
    replicas.beat(session, "a:1:1", {}, started_at=t0, now=gone)
    assert [r["id"] for r in replicas.fleet(session, stale_after_s=15, now=gone)] == ["a:1:1"]
    replicas.remove(session, "a:1:1")
    assert replicas.fleet(session, stale_after_s=15) == []


def test_heartbeat_loop_survives_an_outage_and_stop_is_final(engine, caplog):
    sessions = make_sessionmaker(engine)
    broken = SimpleNamespace(settings=Settings(port=9), engine=None, sessions=_raise)
    state = SimpleNamespace(settings=Settings(port=9), engine=None, sessions=sessions)

    async def run(hb: replicas.Heartbeat) -> None:
        task = asyncio.create_task(hb.run())
        await asyncio.sleep(0.05)  # a few beats
        task.cancel()

    asyncio.run(run(replicas.Heartbeat(broken, 0.01)))
    assert "replica heartbeat failed" in caplog.text

    hb = replicas.Heartbeat(state, 0.01)
    asyncio.run(run(hb))
    with sessions() as s:
        (row,) = replicas.fleet(s, stale_after_s=1)
    assert row["id"] == hb.id and row["id"].endswith(f":9:{os.getpid()}")
    assert row["state"] == {"replica": row["state"]["replica"], "ready": False, "alive": False}
    hb.stop()
    hb.beat_once()  # a beat still under way when the server stops writes nothing
    with sessions() as s:
        assert replicas.fleet(s, stale_after_s=1) == []


def _raise():
    raise ConnectionError("database down")


def test_the_app_beats_lists_its_peers_and_removes_its_row_on_shutdown(tmp_path):
    settings = Settings(data_dir=tmp_path, model=str(tmp_path / "no-model"), admin_key=ADMIN_KEY,
                        replica_heartbeat_s=5.0)  # fmt: skip
    upgrade(settings.database_url)
    db = make_engine(settings.database_url)
    sessions = make_sessionmaker(db)
    t0 = utcnow()
    with sessions() as s:  # a live peer on the same SQLite file, and one that stopped beating
        replicas.beat(s, "peer:1:1", {"replica": "peer", "alive": True, "running": 2,
                                      "resident_adapters": ["7/qv"]}, started_at=t0)  # fmt: skip
        replicas.beat(s, "old:1:1", {}, started_at=t0, now=t0 - timedelta(seconds=60))
    app = create_app(settings, load_model=False)
    this = replicas.replica_id(settings)
    with TestClient(app) as client:
        r = client.get("/admin/api/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["shared"], body["heartbeat_s"]) == (True, 5.0)
        assert [(x["id"], x["this"], x["stale"]) for x in body["data"]] == [
            (this, True, False), ("old:1:1", False, True), ("peer:1:1", False, False)]  # fmt: skip
        peer = body["data"][2]
        assert peer["running"] == 2 and peer["resident_adapters"] == [
            {"adapter": "qv", "tenant_id": 7, "tenant": "7"}]  # fmt: skip
        for _ in range(100):  # the first beat runs as the app starts
            with sessions() as s:
                if this in {x["id"] for x in replicas.fleet(s, stale_after_s=1)}:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("no heartbeat row")
    with sessions() as s:
        assert {x["id"] for x in replicas.fleet(s, stale_after_s=1)} == {"old:1:1", "peer:1:1"}
    db.dispose()


class HeartbeatRows(RuleBasedStateMachine):
    """Replicas beating, stopping, and going silent (a crash) while the clock moves: the rows
    are always those of replicas that beat within GONE_S of the latest beat and did not stop,
    each with its first beat's start, stale exactly when silent for more than STALE_S."""

    STALE_S = 15.0

    def __init__(self, session):
        super().__init__()
        self.session = session
        session.execute(delete(Replica))
        session.commit()
        self.now = utcnow()
        self.model: dict[str, tuple[datetime, datetime]] = {}  # id: (started, seen)

    @rule(rid=st.sampled_from(["a:1:1", "b:1:2", "c:1:3"]), n=st.integers(0, 9))
    def beat(self, rid, n):
        replicas.beat(self.session, rid, {"running": n}, started_at=self.now, now=self.now)
        started = self.model.get(rid, (self.now, None))[0]
        self.model[rid] = (started, self.now)
        cutoff = self.now - timedelta(seconds=replicas.GONE_S)
        self.model = {k: v for k, v in self.model.items() if v[1] >= cutoff}

    @rule(rid=st.sampled_from(["a:1:1", "b:1:2", "c:1:3"]))
    def stop(self, rid):
        replicas.remove(self.session, rid)
        self.model.pop(rid, None)

    @rule(seconds=st.sampled_from([1, 10, 100, 500]))
    def advance(self, seconds):
        self.now += timedelta(seconds=seconds)

    @invariant()
    def rows_match(self):
        rows = replicas.fleet(self.session, stale_after_s=self.STALE_S, now=self.now)
        expected = sorted(self.model.items(), key=lambda kv: (kv[1][0], kv[0]))
        assert [(r["id"], r["started_at"], r["seen_at"]) for r in rows] == [
            (k, started, seen) for k, (started, seen) in expected
        ]
        for r in rows:
            assert r["stale"] == ((self.now - r["seen_at"]).total_seconds() > self.STALE_S)


def test_heartbeat_rows_under_any_interleaving(session):
    run_state_machine_as_test(
        lambda: HeartbeatRows(session),
        settings=hypothesis.settings(max_examples=25, stateful_step_count=12, deadline=None),
    )
