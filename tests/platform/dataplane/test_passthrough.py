"""Request features the vLLM data plane passes through to vLLM, checked on both data planes
(conftest.py): logprobs (and top_logprobs), echo with the prompt's logprobs, n, prompt lists,
structured output (response_format, guided_*, structured_outputs) and forced tool calls; on
vLLM, the logprobs are vLLM's own, token for token."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.platform.dataplane.test_end_to_end import PROMPT, new_tenant, stream_events
from tests.utils.uploads import auth, complete

YES_NO = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}  # fmt: skip


def test_logprobs_echo_n_and_prompt_lists(plane, plane_adapters, request):
    kind, srv = plane
    _, key = new_tenant(srv, plane_adapters, names=("a",))
    r = complete(srv.url, key, "a", PROMPT, max_tokens=5, logprobs=2, ignore_eos=True)
    assert r.status_code == 200, (kind, r.text)
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 2 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the best one

    # echo with logprobs and nothing generated: the prompt scored (the first token has none)
    r = complete(srv.url, key, "a", PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert r.status_code == 200, (kind, r.text)
    body = r.json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == PROMPT and usage["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(x <= 0 for x in choice["logprobs"]["token_logprobs"][1:])

    r = complete(srv.url, key, "a", [PROMPT, "Hello there"], max_tokens=3, n=2,
                 temperature=1.0, seed=5, ignore_eos=True)  # fmt: skip
    assert r.status_code == 200, (kind, r.text)
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == 12  # every choice's tokens
    stream = stream_events(srv, key, {"model": "a", "prompt": PROMPT, "max_tokens": 3, "n": 2,
                                      "ignore_eos": True, "stream_options": {
                                          "include_usage": True}})  # fmt: skip
    assert stream[-2]["usage"]["completion_tokens"] == 6, stream[-2]

    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers=auth(key), timeout=60, json={
        "model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})  # fmt: skip
    assert chat.status_code == 200, (kind, chat.text)
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 for t in content)

    if kind == "vllm":  # the logprobs are vLLM's own: the base model asked both ways
        model = srv.state.model_name
        ours = complete(srv.url, key, model, PROMPT, max_tokens=4, logprobs=3).json()
        url = request.getfixturevalue("vllm_url")
        base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        theirs = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": base, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "logprobs": 3}).json()  # fmt: skip
        a, b = ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"]
        assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
        # (token texts are the platform's rendering of the ids, as on the embedded engine)
        assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert sorted(x.values()) == pytest.approx(sorted(y.values()), abs=1e-4)


def test_structured_output_and_forced_tool_calls(plane, plane_adapters):
    kind, srv = plane
    _, key = new_tenant(srv, plane_adapters, names=("a",))
    fmt = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    r = complete(srv.url, key, "a", PROMPT, max_tokens=24, response_format=fmt)
    assert r.status_code == 200, (kind, r.text)
    assert json.loads(r.json()["choices"][0]["text"]) in ({"answer": "yes"}, {"answer": "no"})

    r = complete(srv.url, key, "a", PROMPT, max_tokens=8, guided_choice=["red", "green"])
    assert r.status_code == 200, (kind, r.text)
    assert r.json()["choices"][0]["text"] in ("red", "green")

    r = complete(srv.url, key, "a", PROMPT, max_tokens=8,
                 structured_outputs={"regex": "[0-9]{3}"})  # fmt: skip
    assert r.status_code == 200, (kind, r.text)
    assert re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"]), r.json()

    # A small tool: the suite's vLLM runs a 256-token context.
    x = {"type": "object", "properties": {"x": {"enum": ["y", "n"]}}, "required": ["x"],
         "additionalProperties": False}  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": x}}
    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers=auth(key), timeout=60, json={
        "model": "a", "messages": [{"role": "user", "content": "?"}], "max_tokens": 48,
        "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}}})  # fmt: skip
    assert chat.status_code == 200, (kind, chat.text)
    (call,) = chat.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) in ({"x": "y"}, {"x": "n"})
