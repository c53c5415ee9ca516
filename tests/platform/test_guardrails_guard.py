"""Guard adapters: a tiny guard trained here to say " unsafe" of any text with a marker,
scored through the engine beside the traffic; the tenant's own or the operator's shared one;
deleted → the policy's documented fail mode (closed: blocked; open: through, and a
`fail_open` event), never a 500."""

from __future__ import annotations

import secrets
import time

import httpx
import openai
import pytest

from loraplex.platform.db.models import UsageRecord
from testkit.guard_training import MARKER, train_guard
from tests.utils.server import ADMIN_KEY, run_server, upload_adapter

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def guard_dir(tiny_models, tmp_path_factory):
    return train_guard(tiny_models["llama"], tmp_path_factory.mktemp("guard") / "guard")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("guarded")) as srv:
        yield srv


def tenant_with_guard(server, guard_dir) -> tuple[int, str]:
    tid, key = server.new_tenant(f"g-{secrets.token_hex(4)}")
    r = upload_adapter(server.url, key, "guard", guard_dir)
    assert r.status_code == 201, r.text
    return tid, key


def add_policy(server, tenant_id: int, **policy) -> None:
    r = httpx.post(f"{server.url}/admin/api/tenants/{tenant_id}/guardrails", headers=ADMIN,
                   json={"name": "guarded", "guard_adapter": "guard", **policy})  # fmt: skip
    assert r.status_code == 201, r.text


def events(server, tenant_id: int) -> list[dict]:
    r = httpx.get(f"{server.url}/admin/api/guardrails/events", headers=ADMIN,
                  params={"tenant_id": tenant_id})  # fmt: skip
    return r.json()["data"]


def ask(server, key: str, text: str, **kw):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    return c.completions.create(model=server.state.model_name, prompt=text, max_tokens=4,
                                temperature=0.0, **kw)  # fmt: skip


CLEAN = ["the cat sat on a mat", "blue sky over the water", "then ran far away home"]
MARKED = ["the cat zqxv sat on a mat", "zqxv blue sky", "ran far away home zqxv"]


def test_the_guard_blocks_its_marker_on_input_for_owner_and_shared_users(server, guard_dir):
    assert all(MARKER in t for t in MARKED)
    operator, _ = tenant_with_guard(server, guard_dir)
    own, own_key = tenant_with_guard(server, guard_dir)
    shared, shared_key = server.new_tenant(f"s-{secrets.token_hex(4)}")
    _, free_key = server.new_tenant(f"f-{secrets.token_hex(4)}")
    add_policy(server, own, stages="input")
    add_policy(server, shared, stages="input", guard_tenant_id=operator)
    for key in (own_key, shared_key):
        for text in CLEAN:
            assert ask(server, key, text).choices[0].finish_reason == "length"
        for text in MARKED:
            with pytest.raises(openai.BadRequestError) as e:
                ask(server, key, text)
            assert e.value.body["code"] == "content_filter"
    for text in MARKED:  # no policy: the marker is just text
        assert ask(server, free_key, text).choices[0].finish_reason == "length"
    for tid in (own, shared):
        got = events(server, tid)
        assert [(x["rule"], x["action"]) for x in got] == [("guard:guard", "block")] * 3


def test_deleted_guard_fails_closed_or_open_as_the_policy_says(server, guard_dir):
    closed, closed_key = tenant_with_guard(server, guard_dir)
    opened, open_key = tenant_with_guard(server, guard_dir)
    add_policy(server, closed, stages="both", fail_mode="closed")
    add_policy(server, opened, stages="both", fail_mode="open")
    for tid in (closed, opened):
        r = httpx.delete(f"{server.url}/admin/api/tenants/{tid}/adapters/guard", headers=ADMIN)
        assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:  # closed: as if the guard said unsafe
        ask(server, closed_key, CLEAN[0])
    assert e.value.body["code"] == "content_filter"
    assert [x["rule"] for x in events(server, closed)] == ["guard_unavailable:guard"]
    r = ask(server, open_key, CLEAN[0], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    got = events(server, opened)  # one per stage, however many windows the output had
    assert sorted((x["stage"], x["action"]) for x in got) == [("input", "fail_open"),
                                                               ("output", "fail_open")]  # fmt: skip
    assert {x["request_id"] for x in got} == {r.id}


def test_output_guard_failing_closed_cuts_before_any_text_and_bills_none(server, guard_dir):
    tid, key = tenant_with_guard(server, guard_dir)
    add_policy(server, tid, stages="output", fail_mode="closed")
    httpx.delete(f"{server.url}/admin/api/tenants/{tid}/adapters/guard", headers=ADMIN)
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    chunks = list(c.chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "hi"}],
        max_tokens=8, stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert text == "" and reasons[-1] == "content_filter"
    assert chunks[-1].usage.completion_tokens == 0
    for _ in range(100):
        if not server.state.inflight:
            break
        time.sleep(0.05)
    with server.sessions() as session:
        row = session.query(UsageRecord).filter_by(request_id=chunks[0].id).one()
    assert row.completion_tokens == 0 and row.status == "ok"


def test_the_guard_cuts_a_stream_whose_output_it_flags(server, guard_dir):
    tid, key = tenant_with_guard(server, guard_dir)
    add_policy(server, tid, stages="output")
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    body = {"model": server.state.model_name, "max_tokens": 24, "temperature": 0.0}
    clean = c.completions.create(prompt="one two three", **body)  # no marker in its answer
    assert "tea" not in clean.choices[0].text and clean.choices[0].finish_reason == "length"
    # The tiny Llama answers "The sky" with " tea tea tea ...": the guard's first window
    # (the first token past the 32 held-back characters) is unsafe, so nothing goes out.
    chunks = list(c.completions.create(prompt="The sky", stream=True,
                                       stream_options={"include_usage": True}, **body))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ""
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "content_filter"
    assert chunks[-1].usage.completion_tokens == 0
    got = events(server, tid)
    assert [(x["rule"], x["stage"], x["action"]) for x in got] == [
        ("guard:guard", "output", "block")]  # fmt: skip
    assert got[0]["request_id"] == chunks[0].id
