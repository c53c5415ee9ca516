"""Adapter versions, aliases and in-place updates through the real server and the unmodified
`openai` client: pins, canary splits, promote and rollback, refusals that change nothing, the
ledger and /metrics naming the version that answered, and a training loop's in-place updates
while streams run (none fails, each answer comes from exactly one version)."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.uploads import auth, folder_parts, upload

KEEP = 3  # adapter_versions_kept for this server: collection shows within a short test
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    data = tmp_path_factory.mktemp("versions")
    with run_server(tiny_models["llama"], data, adapter_versions_kept=KEEP) as srv:
        yield srv


@pytest.fixture(scope="module")
def weights(tiny_adapters, tmp_path_factory) -> list[Path]:
    """Five adapters of one shape with different weights (a training run's checkpoints)."""
    root = tmp_path_factory.mktemp("checkpoints")
    source = tiny_adapters["llama"]["qv4"]
    out = []
    for step in range(5):
        folder = root / f"step-{step}"
        shutil.copytree(source, folder)
        tensors = load_file(source / WEIGHTS)
        save_file({k: v * (1 + 0.6 * step) for k, v in tensors.items()}, folder / WEIGHTS)
        out.append(folder)
    return out


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _text(client: openai.OpenAI, model: str, **kw) -> str:
    kw = {"max_tokens": 4, **kw}
    out = client.completions.create(model=model, prompt="The quick brown", temperature=0, **kw)
    return out.choices[0].text


def _versions_answered(server, tenant_id: int) -> dict[str, int | None]:
    with server.sessions() as session:
        rows = session.execute(
            select(UsageRecord.request_id, UsageRecord.adapter_version).where(
                UsageRecord.tenant_id == tenant_id
            )
        ).all()
    return dict(rows)


def test_pins_aliases_promote_and_rollback(server, tiny_adapters):
    tenant_id, key = server.new_tenant("lifecycle")
    client = _client(server, key)
    llama = tiny_adapters["llama"]
    for folder in (llama["qv4"], llama["attn8"]):
        assert upload(server.url, key, "sql", folder_parts(folder)).status_code == 201
    v1, v2 = _text(client, "sql@v1"), _text(client, "sql@v2")
    assert v1 != v2 and _text(client, "sql") == v1  # a new version waits to be promoted
    for missing in ("sql@v3", "sql@canary", "sql@v0", "sql@", "sql@v1@v2", "other@v1"):
        with pytest.raises(openai.NotFoundError):
            _text(client, missing)

    aliases = f"{server.url}/v1/adapters/sql/aliases"
    made = httpx.put(f"{aliases}/canary", json={"version": "v2"}, headers=auth(key))
    assert made.status_code == 200 and made.json()["weights"] == {"v2": 100}
    assert _text(client, "sql@canary") == v2
    split = httpx.put(f"{aliases}/default", json={"weights": {"v1": 1, "v2": 1}},
                      headers=auth(key))  # fmt: skip
    assert split.status_code == 200, split.text
    admin = httpx.get(f"{server.url}/admin/api/adapters", params={"tenant_id": tenant_id},
                      headers=auth(ADMIN_KEY)).json()["data"]  # fmt: skip
    assert {a["version"]: a["aliases"] for a in admin} == {
        1: {"default": 50},
        2: {"default": 50, "canary": 100},
    }
    by_user = {u: _text(client, "sql", user=u) for u in map(str, range(12))}
    assert set(by_user.values()) == {v1, v2}  # 12 users, even odds: both answer
    assert all(_text(client, "sql", user=u) == text for u, text in by_user.items())

    # Refusals: each a clear 4xx, and nothing changes.
    listing = httpx.get(f"{server.url}/v1/adapters/sql", headers=auth(key)).json()
    for method, path, body, status, code in (
        ("DELETE", "/versions/v1", None, 409, "version_in_use"),
        ("DELETE", "/versions/v7", None, 404, "adapter_not_found"),
        ("PUT", "/aliases/default", {"version": "v9"}, 404, "adapter_not_found"),
        ("PUT", "/aliases/default", {"weights": {"v1": 0}}, 400, "invalid_value"),
        ("PUT", "/aliases/default", {"version": "v1", "weights": {"v1": 1}}, 400, None),
        ("PUT", "/aliases/v3", {"version": "v1"}, 400, "invalid_name"),
        ("DELETE", "/aliases/default", None, 409, "alias_in_use"),
        ("POST", "/aliases/nope/rollback", None, 404, "adapter_not_found"),
    ):
        r = httpx.request(method, f"{server.url}/v1/adapters/sql{path}", json=body,
                          headers=auth(key))  # fmt: skip
        assert r.status_code == status, (path, r.text)
        assert code is None or r.json()["error"]["code"] == code, r.text
    assert httpx.get(f"{server.url}/v1/adapters/sql", headers=auth(key)).json() == listing
    other = server.new_tenant("neighbour")[1]  # another tenant reaches none of it
    assert httpx.put(f"{aliases}/default", json={"version": "v1"},
                     headers=auth(other)).status_code == 404  # fmt: skip

    promoted = httpx.put(f"{aliases}/default", json={"version": "v2"}, headers=auth(key))
    assert promoted.json()["previous"] == {"v1": 1, "v2": 1}
    assert {_text(client, "sql", user=u) for u in by_user} == {v2}
    rolled = httpx.post(f"{aliases}/default/rollback", headers=auth(key))
    assert rolled.status_code == 200 and rolled.json()["weights"] == {"v1": 1, "v2": 1}
    assert all(_text(client, "sql", user=u) == text for u, text in by_user.items())

    # The ledger and /metrics say which version answered each request; /metrics by the served
    # name alone (this module's other tenants serve no "sql"), never by tenant.
    answered = _versions_answered(server, tenant_id)
    assert set(answered.values()) == {1, 2}
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    samples = [
        s
        for f in families
        if f.name == "loraplex_adapter_version_requests"
        for s in f.samples
        if s.name.endswith("_total")
    ]
    assert samples and all(set(s.labels) == {"adapter", "version"} for s in samples)
    counted = {s.labels["version"]: s.value for s in samples if s.labels["adapter"] == "sql"}
    assert counted == {
        f"v{v}": float(list(answered.values()).count(v)) for v in set(answered.values())
    }

    # Deleting an unused version, then the name: all versions and aliases go.
    assert httpx.delete(f"{aliases}/canary", headers=auth(key)).status_code == 200
    assert httpx.put(f"{aliases}/default", json={"version": "v1"},
                     headers=auth(key)).status_code == 200  # fmt: skip
    gone = httpx.delete(f"{server.url}/v1/adapters/sql/versions/v2", headers=auth(key))
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        _text(client, "sql@v2")
    assert httpx.delete(f"{server.url}/v1/adapters/sql", headers=auth(key)).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _text(client, "sql")


def test_in_place_updates_while_streams_run(server, weights):
    """20 in-place updates of one name while 32 streams run: no request fails, each answer is
    exactly the text of the version the ledger says answered it, the ledger has one record per
    answer with the tokens the client received, and old versions are collected."""
    tenant_id, key = server.new_tenant("trainer")
    client = _client(server, key)
    for folder in weights:  # what each checkpoint answers, pinned
        assert upload(server.url, key, "ref", folder_parts(folder)).status_code == 201
    expected = [_text(client, f"ref@v{i + 1}", max_tokens=8) for i in range(len(weights))]
    assert len(set(expected)) == len(weights)
    assert upload(server.url, key, "live", folder_parts(weights[0])).status_code == 201
    checkpoint_of = {1: 0}  # live's version -> the checkpoint it holds

    stop = threading.Event()
    failures: list[str] = []
    answers: list[tuple[str, str, int]] = []  # request id, text, completion tokens

    def stream_loop() -> None:
        while not stop.is_set():
            try:
                chunks = list(client.completions.create(
                    model="live", prompt="The quick brown", max_tokens=8, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                ))  # fmt: skip
            except Exception as e:  # any failure is the test's
                failures.append(repr(e))
                return
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            answers.append((chunks[0].id, text, chunks[-1].usage.completion_tokens))

    with cf.ThreadPoolExecutor(32) as pool:
        streams = [pool.submit(stream_loop) for _ in range(32)]
        started = time.monotonic()
        for n in range(2, 22):  # 20 updates
            step = (n - 1) % len(weights)
            r = httpx.put(f"{server.url}/v1/adapters/live", headers=auth(key),
                          files=folder_parts(weights[step]), timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["version"] == n and r.json()["aliases"] == {"default": {f"v{n}": 100}}
            checkpoint_of[n] = step
        took = time.monotonic() - started
        stop.set()
        for s in streams:
            s.result(timeout=120)

    assert failures == []
    for _ in range(200):  # the last records are written as their streams end
        if not server.state.inflight:
            break
        time.sleep(0.05)
    answered = _versions_answered(server, tenant_id)
    for request_id, text, _ in answers:
        version = answered[request_id]
        assert text == expected[checkpoint_of[version]], (request_id, version)
    live = {v for rid, v in answered.items() if rid in {a[0] for a in answers}}
    print(f"20 in-place updates in {took:.1f}s under 32 streams: {len(answers)} answers, "
          f"0 failed, {len(live)} versions answered")  # fmt: skip
    assert len(live) >= 3  # the updates landed while the streams ran
    with server.sessions() as session:
        billed = session.execute(
            select(UsageRecord.request_id, UsageRecord.completion_tokens).where(
                UsageRecord.tenant_id == tenant_id, UsageRecord.adapter_name == "live"
            )
        ).all()
    assert sorted(billed) == sorted((rid, tokens) for rid, _, tokens in answers)
    listed = httpx.get(f"{server.url}/v1/adapters/live", headers=auth(key)).json()
    assert [v["version"] for v in listed["versions"]] == [19, 20, 21]  # KEEP newest
