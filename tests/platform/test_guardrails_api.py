"""Tenant guardrails on a real server: policies through the admin API, enforced on chat,
completions, prompt lists, streams and the Batch API, with the audit trail exact, the ledger
billing what was sent, and a policy never applied to another tenant (platform/guardrails/)."""

from __future__ import annotations

import json
import re
import secrets
import time

import httpx
import openai
import pytest

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import ADMIN_KEY, run_server

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "The capital of France is"  # the tiny model's greedy answer varies
GEN = {"max_tokens": 24, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("guardrails"),
                    batch_poll_interval_s=0.1) as srv:  # fmt: skip
        yield srv


def new_tenant(server) -> tuple[int, str]:
    return server.new_tenant(f"g-{secrets.token_hex(4)}")


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def add_policy(server, tenant_id: int, **policy) -> dict:
    r = httpx.post(f"{server.url}/admin/api/tenants/{tenant_id}/guardrails", headers=ADMIN,
                   json={"name": "p", **policy})  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()


def events(server, tenant_id: int) -> list[dict]:
    r = httpx.get(f"{server.url}/admin/api/guardrails/events", headers=ADMIN,
                  params={"tenant_id": tenant_id})  # fmt: skip
    assert r.status_code == 200
    return r.json()["data"]


def ledger(server, request_id: str) -> UsageRecord:
    for _ in range(100):  # a request is in flight until its record is written
        if not server.state.inflight:
            break
        time.sleep(0.05)
    with server.sessions() as session:
        return session.query(UsageRecord).filter_by(request_id=request_id).one()


def term_in(text: str, skip: int = 4) -> str:
    """A 4-character piece of `text` first found at or after `skip`: a term to block."""
    for k in range(skip, len(text) - 4):
        term = text[k : k + 4]
        if term.isascii() and term.isalnum() and text.lower().find(term.lower()) == k:
            return term
    pytest.skip(f"no usable term in the tiny model's output {text!r}")


def test_policies_admin_crud_and_tenant_view(server):
    tid, key = new_tenant(server)
    other_tid, other_key = new_tenant(server)
    p = add_policy(server, tid, terms=["x"], pii=["email"], action="redact")
    url = f"{server.url}/admin/api/tenants/{tid}/guardrails"
    assert [x["id"] for x in httpx.get(url, headers=ADMIN).json()["data"]] == [p["id"]]
    mine = httpx.get(f"{server.url}/v1/guardrails", headers={"Authorization": f"Bearer {key}"})
    assert [x["id"] for x in mine.json()["data"]] == [p["id"]]
    theirs = httpx.get(f"{server.url}/v1/guardrails",
                       headers={"Authorization": f"Bearer {other_key}"})  # fmt: skip
    assert theirs.json()["data"] == []
    bad = [
        ({"name": "p", "patterns": ["("]}, "invalid_policy"),
        ({"name": "p", "pii": ["dna"]}, "invalid_policy"),
        ({"name": "p"}, "invalid_policy"),
        ({"name": "p", "terms": ["a"], "action": "erase"}, None),
        ({"name": "p", "terms": ["a"], "actoin": "flag"}, None),
    ]
    for body, code in bad:
        r = httpx.post(url, headers=ADMIN, json=body)
        assert r.status_code in (400, 422), r.text
        if code:
            assert r.json()["error"]["code"] == code
    # Deleting needs the owning tenant: another's id is a 404.
    other = f"{server.url}/admin/api/tenants/{other_tid}/guardrails/{p['id']}"
    assert httpx.delete(other, headers=ADMIN).status_code == 404
    assert httpx.delete(f"{url}/{p['id']}", headers=ADMIN).status_code == 204
    assert httpx.get(url, headers=ADMIN).json()["data"] == []
    r = httpx.post(url, headers={"Authorization": f"Bearer {key}"}, json={"name": "x"})
    assert r.status_code in (401, 403)  # tenants read their policies, never write them


def test_input_block_on_chat_and_completions_never_on_another_tenant(server):
    tid, key = new_tenant(server)
    _, other_key = new_tenant(server)
    add_policy(server, tid, name="no-secrets", stages="input", terms=["Project Falcon"])
    base = server.state.model_name
    msgs = [{"role": "user", "content": "tell me about project falcon"}]
    with pytest.raises(openai.BadRequestError) as e:
        client(server, key).chat.completions.create(model=base, messages=msgs, max_tokens=2)
    err = e.value.body
    assert err["code"] == "content_filter" and err["param"] == "messages"
    assert "no-secrets" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(server, key).completions.create(model=base, prompt=["fine", "PROJECT FALCON"],
                                               max_tokens=2)  # fmt: skip
    assert e.value.body["code"] == "content_filter"
    # Another tenant's same request runs.
    ok = client(server, other_key).chat.completions.create(model=base, messages=msgs, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    got = events(server, tid)
    assert [(x["action"], x["stage"], x["rule"]) for x in got] == [("block", "input", "term")] * 2
    assert {x["route"] for x in got} == {"chat", "completions"}
    assert all(x["text"] is None and x["request_id"].startswith("blocked-") for x in got)
    assert got[1]["request_id"] in err["message"]  # the error names its audit id


def test_input_redaction_and_flag_with_recorded_text(server):
    tid, key = new_tenant(server)
    add_policy(server, tid, name="pii", stages="input", action="redact", pii=["email", "card"])
    add_policy(server, tid, name="watch", stages="input", action="flag", terms=["invoice"],
               record_text=True)  # fmt: skip
    prompt = "invoice for bob@example.com, card 4111 1111 1111 1111, thanks"
    r = client(server, key).completions.create(model=server.state.model_name, prompt=prompt,
                                               echo=True, max_tokens=1)  # fmt: skip
    assert r.choices[0].text.startswith("invoice for [REDACTED], card [REDACTED], thanks")
    got = {(x["rule"], x["action"]): x for x in events(server, tid)}
    assert set(got) == {("pii:email", "redact"), ("pii:card", "redact"), ("term", "flag")}
    assert {x["request_id"] for x in got.values()} == {r.id}  # the usage record's id
    assert got[("term", "flag")]["text"] == "invoice"
    assert got[("pii:email", "redact")]["text"] is None  # that policy records no text


def test_text_is_recorded_only_once_the_tenant_opts_in(server):
    tid, key = new_tenant(server)
    other_tid, other_key = new_tenant(server)
    policy = add_policy(server, tid, name="watch", stages="input", action="flag",
                        terms=["invoice"])  # fmt: skip
    assert policy["record_text"] is False  # the default: no prompt text kept
    url = f"{server.url}/v1/guardrails/policies/{policy['id']}"

    def opt(api_key: str, body) -> httpx.Response:
        return httpx.patch(url, headers={"Authorization": f"Bearer {api_key}"}, json=body)

    def ask(prompt: str) -> str:
        r = client(server, key).completions.create(model=server.state.model_name,
                                                   prompt=prompt, max_tokens=1)  # fmt: skip
        return r.id

    before = ask("an invoice, please")
    assert opt(other_key, {"record_text": True}).status_code == 404  # not its policy
    for bad in ({"record_text": "yes"}, {"record_text": True, "action": "flag"}, {}):
        assert opt(key, bad).status_code == 400, bad  # nothing else a tenant may change
    assert opt(key, {"record_text": True}).json()["record_text"] is True
    during = ask("the invoice again")
    assert opt(key, {"record_text": False}).status_code == 200
    after = ask("one more invoice")
    got = events(server, tid)
    text = {x["request_id"]: x["text"] for x in got if x["action"] != "policy_edit"}
    assert text == {before: None, during: "invoice", after: None}
    # Each opt-in and opt-out is in the trail too, made by the tenant's key (newest first).
    edits = [x for x in got if x["action"] == "policy_edit"]
    assert [(x["rule"], json.loads(x["text"]), x["route"]) for x in edits] == [
        ("edit:record_text", {"record_text": [True, False]}, "tenant"),
        ("edit:record_text", {"record_text": [False, True]}, "tenant"),
    ]
    assert all(x["api_key_id"] is not None for x in edits)
    assert events(server, other_tid) == []


def test_the_operator_edits_a_policy_checked_whole_and_audited(server):
    tid, key = new_tenant(server)
    other_tid, other_key = new_tenant(server)
    p = add_policy(server, tid, name="nuts", stages="input", terms=["walnut"])
    url = f"{server.url}/admin/api/tenants/{tid}/guardrails/{p['id']}"
    base = server.state.model_name

    def ask(prompt: str) -> None:
        client(server, key).completions.create(model=base, prompt=prompt, max_tokens=1)

    with pytest.raises(openai.BadRequestError):
        ask("a walnut")
    r = httpx.patch(url, headers=ADMIN, json={"action": "flag", "terms": ["pecan"]})
    assert r.status_code == 200, r.text
    assert (r.json()["action"], r.json()["terms"], r.json()["name"]) == ("flag", ["pecan"], "nuts")
    ask("a walnut")  # the old term no longer applies, from the next request on
    ask("a pecan")  # flagged, not blocked
    assert [(x["rule"], x["action"]) for x in events(server, tid)][:1] == [("term", "flag")]
    with server.sessions() as session:
        from loraplex.platform.db import crud

        _, other_key_row = crud.create_key(session, tenant_id=other_tid)
    before = httpx.get(f"{server.url}/admin/api/tenants/{tid}/guardrails", headers=ADMIN).json()
    bad = [
        ({"patterns": ["("]}, 400, "invalid_policy"),
        ({"terms": []}, 400, "invalid_policy"),  # left with no check
        ({"name": None}, 400, "invalid_policy"),
        ({"action": "erase"}, 400, None),
        ({"actoin": "block"}, 400, None),
        ({"guard_tenant_id": tid}, 400, "invalid_policy"),  # no guard to own
        ({"api_key_id": other_key_row.id}, 404, "key_not_found"),  # another tenant's key
        ({"record_text": True}, 400, None),  # the tenant's choice, not the operator's
    ]
    for body, status, code in bad:
        r = httpx.patch(url, headers=ADMIN, json=body)
        assert r.status_code == status, (body, r.text)
        assert code is None or r.json()["error"]["code"] == code, r.text
    other_url = f"{server.url}/admin/api/tenants/{other_tid}/guardrails/{p['id']}"
    assert httpx.patch(other_url, headers=ADMIN, json={"action": "block"}).status_code == 404
    r = httpx.patch(url, headers={"Authorization": f"Bearer {other_key}"}, json={"name": "x"})
    assert r.status_code in (401, 403)  # a tenant edits no policy, its own included
    after = httpx.get(f"{server.url}/admin/api/tenants/{tid}/guardrails", headers=ADMIN).json()
    assert after == before  # nothing of a refused edit was written
    # A guard named where there was none is the tenant's own; removing it clears its owner.
    r = httpx.patch(url, headers=ADMIN, json={"guard_adapter": "g", "fail_mode": "open"})
    assert (r.json()["guard_adapter"], r.json()["guard_tenant_id"]) == ("g", tid)
    r = httpx.patch(url, headers=ADMIN, json={"guard_adapter": None})
    assert (r.json()["guard_adapter"], r.json()["guard_tenant_id"]) == (None, None)
    assert httpx.patch(url, headers=ADMIN, json={"fail_mode": "open"}).status_code == 200
    edits = [x for x in events(server, tid) if x["action"] == "policy_edit"]
    assert [(x["rule"], x["route"], x["api_key_id"]) for x in edits] == [
        ("edit:guard_adapter,guard_tenant_id", "admin", None),
        ("edit:fail_mode,guard_adapter,guard_tenant_id", "admin", None),
        ("edit:action,terms", "admin", None),
    ]  # an edit that changes nothing (the last) leaves no event
    assert json.loads(edits[-1]["text"]) == {"action": ["block", "flag"],
                                             "terms": [["walnut"], ["pecan"]]}  # fmt: skip
    counts = httpx.get(f"{server.url}/admin/api/billing", headers=ADMIN).json()
    assert {"tenant_id": tid, "block": 1, "flag": 1} in counts["guardrail_counts"]  # no edits
    assert events(server, other_tid) == []


def test_per_key_policy(server):
    tid, key = new_tenant(server)
    with server.sessions() as session:
        from loraplex.platform.db import crud

        key2, row = crud.create_key(session, tenant_id=tid)
    add_policy(server, tid, stages="input", terms=["blue"], api_key_id=row.id)
    base = server.state.model_name
    assert client(server, key).completions.create(model=base, prompt="blue", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client(server, key2).completions.create(model=base, prompt="blue", max_tokens=1)


def test_output_block_whole_and_streamed_bills_what_was_sent(server):
    tid, key = new_tenant(server)
    c = client(server, key)
    base = server.state.model_name
    msgs = [{"role": "user", "content": "Once upon a time"}]
    plain = c.chat.completions.create(model=base, messages=msgs, **GEN)
    text = plain.choices[0].message.content
    term = term_in(text)
    add_policy(server, tid, name="cut", stages="output", terms=[term])
    whole = c.chat.completions.create(model=base, messages=msgs, **GEN)
    got = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "content_filter"
    assert text.startswith(got) and term.lower() not in got.lower()
    assert whole.usage.completion_tokens < plain.usage.completion_tokens
    assert ledger(server, whole.id).completion_tokens == whole.usage.completion_tokens
    stream = c.chat.completions.create(model=base, messages=msgs, stream=True,
                                       stream_options={"include_usage": True}, **GEN)  # fmt: skip
    parts, reasons, usage, rid = [], [], None, None
    for chunk in stream:
        rid = chunk.id
        usage = chunk.usage or usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(parts) == got and reasons[-1] == "content_filter"
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert ledger(server, rid).completion_tokens == usage.completion_tokens
    assert [x["rule"] for x in events(server, tid)] == ["term"] * 2


def test_output_redaction_whole_and_streamed(server):
    tid, key = new_tenant(server)
    base = server.state.model_name
    plain = client(server, key).completions.create(model=base, prompt=PROMPT, **GEN)
    text = plain.choices[0].text
    term = term_in(text)
    add_policy(server, tid, stages="output", action="redact", terms=[term])
    want = re.sub(re.escape(term), "[REDACTED]", text, flags=re.IGNORECASE)
    whole = client(server, key).completions.create(model=base, prompt=PROMPT, **GEN)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == plain.usage.completion_tokens
    stream = client(server, key).completions.create(model=base, prompt=PROMPT, stream=True,
                                                    **GEN)  # fmt: skip
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want
    with pytest.raises(openai.BadRequestError) as e:  # logprobs would show the redacted tokens
        client(server, key).completions.create(model=base, prompt="x", logprobs=2, max_tokens=2)
    assert e.value.body["code"] == "unsupported_with_guardrails"


def test_prompt_list_output_block_cuts_only_that_prompt(server):
    tid, key = new_tenant(server)
    base = server.state.model_name
    prompts = [PROMPT, "one two three"]
    plain = client(server, key).completions.create(model=base, prompt=prompts, **GEN)
    a, b = (ch.text for ch in plain.choices)
    term = term_in(a)
    if term.lower() in b.lower():
        pytest.skip("the term is in both outputs")
    add_policy(server, tid, stages="output", terms=[term])
    r = client(server, key).completions.create(model=base, prompt=prompts, **GEN)
    assert [ch.finish_reason for ch in r.choices] == ["content_filter", "length"]
    assert a.startswith(r.choices[0].text) and r.choices[1].text == b
    first, second = ledger(server, f"{r.id}-0"), ledger(server, f"{r.id}-1")
    assert second.completion_tokens == 24 and first.completion_tokens < 24
    assert first.completion_tokens + second.completion_tokens == r.usage.completion_tokens


def test_batch_api_lines_follow_the_policy(server):
    tid, key = new_tenant(server)
    add_policy(server, tid, stages="input", terms=["forbidden"])
    base = server.state.model_name
    items = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": base, "max_tokens": 2, "messages": [{"role": "user", "content": c}]}}
        for cid, c in (("ok", "hello"), ("bad", "a forbidden word"))
    ]  # fmt: skip
    c = client(server, key)
    data = "".join(json.dumps(x) + "\n" for x in items).encode()
    f = c.files.create(file=("in.jsonl", data), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 60
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, b.status
        time.sleep(0.2)
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 1)
    err = json.loads(c.files.content(b.error_file_id).text.splitlines()[0])
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "content_filter"
    counts = httpx.get(f"{server.url}/admin/api/billing", headers=ADMIN).json()
    assert {"tenant_id": tid, "block": 1} in counts["guardrail_counts"]


def test_the_portal_shows_the_tenants_own_policies_and_events(server):
    tid, key = new_tenant(server)
    other_tid, _ = new_tenant(server)
    add_policy(server, tid, name="mine", stages="input", terms=["walnut"])
    add_policy(server, other_tid, name="theirs", stages="input", terms=["walnut"])
    with pytest.raises(openai.BadRequestError):
        client(server, key).completions.create(model=server.state.model_name, prompt="walnut",
                                               max_tokens=1)  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as portal:
        assert portal.post("/portal/login", data={"api_key": key}).status_code == 303
        got = portal.get("/portal/api/guardrails").json()
        # The portal's opt-in switch: the session's CSRF token needed, its own policy only.
        csrf = {"X-CSRF-Token": portal.get("/portal/session").json()["csrf_token"]}
        others = f"{server.url}/admin/api/tenants/{other_tid}/guardrails"
        mine = got["policies"][0]["id"]
        theirs = httpx.get(others, headers=ADMIN).json()["data"][0]["id"]
        path = "/portal/api/guardrails/policies/{}/record_text"
        on = {"record_text": True}
        assert portal.put(path.format(mine), json=on).status_code == 403  # no CSRF header
        assert portal.put(path.format(theirs), json=on, headers=csrf).status_code == 404
        bad = portal.put(path.format(mine), json={"record_text": "yes"}, headers=csrf)
        assert bad.status_code == 400
        r = portal.put(path.format(mine), json=on, headers=csrf)
        assert r.status_code == 200 and r.json()["record_text"] is True
    assert [p["name"] for p in got["policies"]] == ["mine"]
    assert [(e["policy_name"], e["action"]) for e in got["events"]] == [("mine", "block")]
    assert httpx.get(f"{server.url}/portal/api/guardrails").status_code == 401
    mine_now = httpx.get(f"{server.url}/v1/guardrails", headers={"Authorization": f"Bearer {key}"})
    assert [p["record_text"] for p in mine_now.json()["data"]] == [True]
    theirs_now = httpx.get(f"{server.url}/admin/api/tenants/{other_tid}/guardrails", headers=ADMIN)
    assert [p["record_text"] for p in theirs_now.json()["data"]] == [False]


def test_streamed_prompt_list_cuts_only_that_prompt(server):
    tid, key = new_tenant(server)
    base = server.state.model_name
    prompts = [PROMPT, "one two three"]
    plain = client(server, key).completions.create(model=base, prompt=prompts, **GEN)
    a, b = (ch.text for ch in plain.choices)
    term = term_in(a)
    if term.lower() in b.lower():
        pytest.skip("the term is in both outputs")
    add_policy(server, tid, stages="output", terms=[term])
    chunks = list(client(server, key).completions.create(
        model=base, prompt=prompts, stream=True, stream_options={"include_usage": True}, **GEN
    ))  # fmt: skip
    text = {0: "", 1: ""}
    reason = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.text
            reason[c.index] = c.finish_reason or reason.get(c.index)
    assert reason == {0: "content_filter", 1: "length"}
    assert a.startswith(text[0]) and term.lower() not in text[0].lower() and text[1] == b
    rid = chunks[0].id
    first, second = ledger(server, f"{rid}-0"), ledger(server, f"{rid}-1")
    assert second.completion_tokens == 24 and first.completion_tokens < 24
    assert first.completion_tokens + 24 == chunks[-1].usage.completion_tokens
