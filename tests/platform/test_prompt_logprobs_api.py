"""Prompt logprobs through the official `openai` client: `echo` with `logprobs` (OpenAI's
legacy object over prompt then completion tokens), `max_tokens: 0` to score a prompt, and
vLLM's `prompt_logprobs` extension; in the engine process and in a thread of the server."""

from __future__ import annotations

import openai
import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.platform.db.models import UsageRecord
from tests.utils.server import run_server, upload_adapter

PROMPT = "The quick brown fox jumps over"
MAX = 5
EXTRA = {"ignore_eos": True}
LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, tiny_models, tiny_adapters, tmp_path_factory):
    process = request.param == "process"
    folder = tmp_path_factory.mktemp(f"prompt-lp-{request.param}")
    with run_server(tiny_models["llama"], folder, engine_process=process) as srv:
        _, key = srv.new_tenant("scorer")
        assert upload_adapter(srv.url, key, "qv", tiny_adapters["llama"]["qv4"]).status_code == 201
        srv.key = key
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_models, tiny_adapters):
    """The engine alone, same model and dtype: what the server must pass on."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32")
    lora = LoRARequest("qv", 1, str(tiny_adapters["llama"]["qv4"]))

    def score(prompt: str, adapter: bool, k: int):
        params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=k)
        (out,) = llm.generate([prompt], params, [lora if adapter else None])
        return out.prompt_token_ids, out.prompt_logprobs

    return score


def _model(server, adapter: bool) -> str:
    return "qv" if adapter else server.state.model_name


def _complete(client, server, adapter=False, **kw):
    """A completion; `x`: vLLM's extension fields (extra_body)."""
    extra = {**EXTRA, **kw.pop("x", {})}
    body = dict(model=_model(server, adapter), prompt=PROMPT, max_tokens=MAX, temperature=0)
    return client.completions.create(**{**body, **kw}, extra_body=extra)


def _legacy(lp) -> dict:
    return {k: getattr(lp, k) for k in LEGACY_KEYS}


def _check_offsets(text: str, lp: dict, special: set[str]) -> None:
    """text_offset slices the choice's text into its tokens. A special token takes none; the
    random model may write bytes of a multi-byte character (token text U+FFFD): their text
    comes with the token that completes (or follows) them, as the detokenizer writes it."""
    offsets = lp["text_offset"] + [len(text)]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    held = False
    for i, tok in enumerate(lp["tokens"]):
        piece = text[offsets[i] : offsets[i + 1]]
        if "\ufffd" in tok:
            held = True
        elif tok in special:
            assert piece == "", f"token {i}: {tok!r} vs {piece!r}"
        else:
            assert piece.endswith(tok) if held else piece == tok, f"token {i}: {tok!r} {piece!r}"
            held = False


def _special(server) -> set[str]:
    tok = server.state.engine.tokenizer
    return {tok.decode([t], skip_special_tokens=False) for t in tok.special_token_ids}


@pytest.mark.parametrize("adapter", [False, True])
def test_echo_logprobs_cover_the_prompt_then_the_completion(client, server, offline, adapter):
    plain = _complete(client, server, adapter, logprobs=2)
    r = _complete(client, server, adapter, logprobs=2, echo=True)
    ids, scored = offline(PROMPT, adapter, 2)
    c = r.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    lp = _legacy(c.logprobs)
    n = len(ids)
    assert len(lp["tokens"]) == n + MAX
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:n]
    assert max(abs(a - b) for a, b in zip(got, scored.token_logprobs[1:], strict=True)) < 1e-6
    for i in range(1, n):  # the prompt token and the 2 most likely, by text
        entry = lp["top_logprobs"][i]
        assert entry[lp["tokens"][i]] == lp["token_logprobs"][i] and 2 <= len(entry) <= 3
        best = max(entry.values())
        assert abs(best - scored.top[i][0][1]) < 1e-6
    # The completion's part is what the request without echo returned.
    tail = {k: v[n:] for k, v in lp.items()}
    assert tail["tokens"] == plain.choices[0].logprobs.tokens
    assert tail["token_logprobs"] == plain.choices[0].logprobs.token_logprobs
    assert tail["top_logprobs"] == plain.choices[0].logprobs.top_logprobs
    _check_offsets(c.text, lp, _special(server))
    _check_offsets(plain.choices[0].text, _legacy(plain.choices[0].logprobs), set())
    # Billing: the prompt once, as without echo.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, MAX)
    with server.sessions() as session:
        row = session.query(UsageRecord).filter_by(request_id=r.id).one()
    assert (row.prompt_tokens, row.completion_tokens) == (n, MAX)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_echo_logprobs_join_to_the_whole_answer(client, server, n):
    kw = dict(logprobs=3, echo=True, n=n, temperature=1.0, seed=4)
    whole = _complete(client, server, **kw)
    texts: dict[int, str] = {}
    pieces: dict[int, dict] = {}
    for chunk in _complete(client, server, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            got = pieces.setdefault(c.index, {k: [] for k in LEGACY_KEYS})
            for k, v in _legacy(c.logprobs).items():
                got[k] += v
    assert texts == {c.index: c.text for c in whole.choices}
    assert pieces == {c.index: _legacy(c.logprobs) for c in whole.choices}
    for c in whole.choices:
        _check_offsets(c.text, pieces[c.index], _special(server))


def test_max_tokens_zero_with_echo_scores_the_prompt(client, server, offline):
    ids, scored = offline(PROMPT, True, 1)
    r = _complete(client, server, True, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (PROMPT, "length")
    assert c.logprobs.token_logprobs == scored.token_logprobs
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    _check_offsets(c.text, _legacy(c.logprobs), _special(server))
    chunks = list(_complete(client, server, True, max_tokens=0, echo=True, logprobs=1, stream=True))
    (only,) = [ch for ch in chunks if ch.choices]
    assert only.choices[0].text == PROMPT and _legacy(only.choices[0].logprobs) == _legacy(
        c.logprobs
    )
    # echo alone: the prompt back, nothing generated
    r = _complete(client, server, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 0


def _vllm_check(entries: list, ids: list[int], scored, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - scored.token_logprobs[i]) < 1e-6
        assert own["rank"] == scored.ranks[i] and isinstance(own["decoded_token"], str)
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= k)
        assert [t for _, t in ranked] == [t for t, _ in scored.top[i][:k]]
        assert len(entry) in (k, k + 1)


def test_vllm_prompt_logprobs_on_completions_and_chat(client, server, offline):
    ids, scored = offline(PROMPT, False, 3)
    r = _complete(client, server, n=2, temperature=1.0, seed=1, x={"prompt_logprobs": 3})
    for c in r.choices:
        _vllm_check(c.model_extra["prompt_logprobs"], ids, scored, 3)
        assert c.logprobs is None  # logprobs were not asked
    assert r.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=server.state.model_name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        extra_body={"prompt_logprobs": 0},
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"x": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"x": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"x": {"prompt_logprobs": "2"}}, "prompt_logprobs"),
        ({"x": {"prompt_logprobs": 2}, "stream": True}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "best_of": 2}, "best_of"),
    ],
)
def test_bad_values_are_refused_by_name(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, server, **kw)
    assert e.value.body["param"] == param, e.value.body
