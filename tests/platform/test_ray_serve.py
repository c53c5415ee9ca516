"""Ray Serve mode on a real local Ray cluster: 2 replicas of the app on one PostgreSQL
database and one store, requests naming their adapter in `serve_multiplexed_model_id`.

Skipped (with the reason) only when Ray cannot start on this machine; `ray` is in the test
extra, so a missing install fails.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import Counter

import pytest
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.ray_serve import (
    APP_NAME,
    LOAD_HEADER,
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_HEADER,
    application,
)
from loraplex.platform.settings import Settings
from testkit.factories import make_adapter
from tests.platform.conftest import _empty_pg_schema
from tests.utils.fleet import complete, new_tenant, received_usage
from tests.utils.moto import free_port
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import folder_parts, upload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_models, pg_database_url, tmp_path_factory):
    import os

    import ray
    from ray import serve

    _empty_pg_schema(pg_database_url)
    upgrade(pg_database_url)
    root = tmp_path_factory.mktemp("ray-fleet")
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # the local cluster's proxy inherits it
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any reason Ray cannot start here
        # A failure, not a skip: CI installs ray, and a Ray that cannot start is a finding.
        pytest.fail(f"a local Ray cluster cannot start on this machine: {e}")
    port = free_port()
    db = make_engine(pg_database_url)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = Settings(
            data_dir=root / "data",
            model=str(tiny_models["llama"]),
            database_url=pg_database_url,
            store_url=(root / "store").as_uri(),  # one node: one folder for both replicas
            admin_key=ADMIN_KEY,
            dtype="float32",
            max_model_len=256,
            max_loras=2,
            engine_threads=1,
            engine_process=False,  # one process per replica on 2 cores
        )
        serve.run(application(settings, num_replicas=2), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _, _, key = new_tenant(url, "ray-tenant")
        for name, seed in (("a", 1), ("b", 2), ("c", 3)):
            folder = make_adapter(tiny_models["llama"], root / name, r=4, seed=seed)
            response = upload(url, key, name, folder_parts(folder))
            assert response.status_code == 201, response.text
        yield url, key, make_sessionmaker(db)
    finally:
        db.dispose()
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(PROXY_CALLBACK_ENV, None)


def _ledger(sessions, request_ids) -> dict[str, tuple[int, int]]:
    with sessions() as session:
        rows = session.execute(
            select(UsageRecord.request_id, UsageRecord.prompt_tokens,
                   UsageRecord.completion_tokens)
            .where(UsageRecord.request_id.in_(list(request_ids)))
        ).all()  # fmt: skip
    return {rid: (p, c) for rid, p, c in rows}


def _records(sessions) -> dict[str, str]:
    """request id -> status of every usage record."""
    with sessions() as session:
        return dict(session.execute(select(UsageRecord.request_id, UsageRecord.status)).all())


def test_requests_for_an_adapter_concentrate_on_the_replica_that_holds_it(fleet):
    url, key, _ = fleet
    holders = {}
    for name in ("a", "b"):  # each adapter's first request: a cold load on some replica
        first = complete(url, key, name)
        assert first.status_code == 200, first.text
        assert first.headers[LOAD_HEADER] == "cold"
        holders[name] = first.headers[REPLICA_HEADER]
    time.sleep(1.0)  # replicas report what they hold every 0.1 s; routers learn it after
    jobs = ["a", "b"] * 8
    with cf.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda name: complete(url, key, name), jobs))
    assert [r.status_code for r in responses] == [200] * len(jobs)
    answers = Counter((n, r.headers[REPLICA_HEADER], r.headers[LOAD_HEADER])
                      for n, r in zip(jobs, responses, strict=True))  # fmt: skip
    print(f"holders {holders}; answers {dict(answers)}")
    # Every later request went to the replica holding its adapter; none loaded it again.
    assert answers == Counter({(n, holders[n], "warm"): 8 for n in ("a", "b")})


def test_usage_ledger_equals_what_clients_received(fleet):
    url, key, sessions = fleet
    _, _, other = new_tenant(url, "ledger")
    assert complete(url, other, "a").status_code == 404  # not this tenant's adapter
    jobs = [(k, m, s) for k, m in ((key, "a"), (key, "b"), (key, "llama"), (other, "llama"))
            for s in (False, True)] * 2  # fmt: skip
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda j: complete(url, j[0], j[1], max_tokens=5,
                                                     stream=j[2]), jobs))  # fmt: skip
    assert [r.status_code for r in responses] == [200] * len(jobs), [r.text for r in responses]
    received = {rid: (p, c) for rid, p, c in map(received_usage, responses)}
    assert len(received) == len(jobs)
    ledger = _ledger(sessions, received)
    assert ledger == received
    print(f"ledger: {len(ledger)} records, {sum(c for _, c in ledger.values())} completion "
          f"tokens = received")  # fmt: skip


def test_a_replica_killed_under_load_fails_or_finishes_its_requests_cleanly(fleet):
    import ray

    url, key, sessions = fleet
    holder = complete(url, key, "a").headers[REPLICA_HEADER]
    records_before = _records(sessions)
    with cf.ThreadPoolExecutor(8) as pool:
        # "c" was never requested: its first request runs the loader on some replica.
        futures = [pool.submit(complete, url, key, name, max_tokens=48)
                   for name in ("a", "c") * 4]  # fmt: skip
        time.sleep(0.3)
        started = time.monotonic()
        ray.kill(ray.get_actor(holder, namespace="serve"), no_restart=True)
        responses = [f.result(timeout=60) for f in futures]
        waited = time.monotonic() - started
    ok = [r for r in responses if r.status_code == 200]
    failed = [r for r in responses if r.status_code != 200]
    print(
        f"killed {holder}: {len(ok)} finished, failed {Counter(r.status_code for r in failed)}"
        f" {[r.text[:200] for r in failed][:2]}, all answered {waited:.1f}s after the kill"
    )
    for r in failed:  # the proxy's bare 500 is replaced by our 503
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.json()["error"]["code"] == "replica_unavailable"
        assert r.headers["retry-after"] == "1"
    # Only what clients received is billed: no record for a request its replica took along,
    # but for the one window no server closes: a request that finished on the killed replica,
    # its record written, while its answer was still on its way through the proxy (its client
    # got the 503). Such a record is a whole one (status ok), one per 503 at most.
    received = {rid: (p, c) for rid, p, c in map(received_usage, ok)}
    assert _ledger(sessions, received) == received
    new = {rid: st for rid, st in _records(sessions).items() if rid not in records_before}
    unseen = [st for rid, st in new.items() if rid not in received]
    assert set(received) <= set(new) and len(unseen) <= len(failed), (len(new), len(ok))
    assert all(st == "ok" for st in unseen), unseen
    # The survivor serves at once, the adapter included.
    after = complete(url, key, "a")
    assert after.status_code == 200, after.text
    assert after.headers[REPLICA_HEADER] != holder


def test_replicas_ask_ray_for_a_gpu_where_their_engine_runs_on_one():
    """Ray shows an actor only the GPUs it asked for: a replica whose engine is to run on a
    GPU asks for one, a CPU replica for none, and a GPU the cluster lacks is refused rather
    than left pending."""
    from loraplex.platform.ray_serve import replica_resources

    cpu, gpu = {"num_cpus": 0}, {"num_cpus": 0, "num_gpus": 1}
    assert replica_resources("auto", 0) == cpu and replica_resources("auto", 4) == gpu
    assert replica_resources("cpu", 4) == cpu
    assert replica_resources("cuda", 2) == gpu and replica_resources("cuda:1", 2) == gpu
    with pytest.raises(ValueError, match="the Ray cluster has no GPU; pass --device cpu or auto"):
        replica_resources("cuda", 0)
