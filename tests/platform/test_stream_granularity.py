"""Stream granularity, through the official `openai` client: a streamed answer sends a chunk per
token by default (as vLLM does), `stream_interval` tokens per chunk when set; the streamed text
equals the whole answer and the usage ledger what was sent.

The tiny model's steps are shorter than the engine process's COALESCE_S, so each of its
messages to the server covers several steps: these tests check that they still stream per
token."""

from __future__ import annotations

import time

import openai
import pytest

from loraplex.platform.cli import _settings, build_parser
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.settings import Settings
from tests.utils.server import run_server

MAX = 30
EXTRA = {"ignore_eos": True}  # every answer runs to max_tokens


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("granularity")) as srv:
        assert srv.settings.engine_process  # the mode whose messages cover several steps
        yield srv


@pytest.fixture(scope="module")
def tenant(server):
    return server.new_tenant("granularity")


@pytest.fixture(scope="module")
def client(server, tenant):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant[1], max_retries=0)


@pytest.fixture
def interval(server, monkeypatch):
    def set_interval(n: int) -> None:  # read per request: no restart needed
        monkeypatch.setattr(server.state.settings, "stream_interval", n)

    return set_interval


def _completion(client, server, stream: bool, prompt="The capital of France is"):
    return client.completions.create(
        model=server.state.model_name, prompt=prompt, max_tokens=MAX, temperature=0,
        logprobs=1, stream=stream, extra_body=EXTRA,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )  # fmt: skip


def _chat(client, server, stream: bool, logprobs: bool, text="Tell me a story"):
    return client.chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": text}],
        max_tokens=MAX, temperature=0, logprobs=logprobs, stream=stream, extra_body=EXTRA,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )  # fmt: skip


def _billed(server, tenant, request_id: str) -> int:
    for _ in range(100):  # a request is in flight until its record is written
        if not server.state.inflight:
            break
        time.sleep(0.05)
    with server.sessions() as session:
        row = session.query(UsageRecord).filter_by(tenant_id=tenant[0], request_id=request_id)
        return row.one().completion_tokens


def _completion_sizes(chunks) -> tuple[list[int], str, int]:
    """(tokens per chunk, as its logprobs list them; the text; usage's completion_tokens)."""
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    return sizes, text, usage.completion_tokens


@pytest.mark.parametrize("every", [1, 4])
def test_completion_chunks_carry_stream_interval_tokens(server, client, tenant, interval, every):
    interval(every)
    whole = _completion(client, server, stream=False)
    chunks = list(_completion(client, server, stream=True))
    sizes, text, completion_tokens = _completion_sizes(chunks)
    assert completion_tokens == MAX == sum(sizes)
    if every == 1:  # a chunk per token, also for tokens with no text (their text is "")
        assert sizes == [1] * MAX
    else:  # as vLLM: the first token at once, then every 4 tokens, then the rest
        assert sizes[0] == 1 and set(sizes[1:-1]) == {4} and 1 <= sizes[-1] <= 4, sizes
    assert text == whole.choices[0].text
    assert _billed(server, tenant, chunks[0].id) == MAX


def _chat_chunks(client, server, logprobs: bool):
    """(per chunk with a choice: its content and the tokens its logprobs list; usage)."""
    chunks = list(_chat(client, server, stream=True, logprobs=logprobs))
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    got = [
        (c.choices[0].delta.content, c.choices[0].logprobs and c.choices[0].logprobs.content)
        for c in chunks
        if c.choices
    ]
    return chunks[0].id, got, usage.completion_tokens


@pytest.mark.parametrize("every", [1, 4])
def test_chat_chunks_carry_stream_interval_tokens(server, client, tenant, interval, every):
    interval(every)
    whole = _chat(client, server, stream=False, logprobs=False).choices[0].message.content
    rid, got, completion_tokens = _chat_chunks(client, server, logprobs=True)
    sizes = [len(lps) for _, lps in got]
    assert completion_tokens == MAX == sum(sizes)
    assert "".join(text for text, _ in got) == whole
    assert _billed(server, tenant, rid) == MAX
    if every == 1:
        assert sizes == [1] * MAX  # with logprobs, also a token with no text gets its chunk
    else:
        assert sizes[0] == 1 and set(sizes[1:-1]) == {4} and 1 <= sizes[-1] <= 4, sizes
    # Without logprobs, a token with no text of its own (a skipped special token, part of a
    # UTF-8 character) sends no chunk: its token goes with the next one. Which tokens those
    # are, the run above says (the first and the last chunk are always sent).
    silent = sum(1 for text, _ in got[1:-1] if not text) if every == 1 else None
    rid, plain, completion_tokens = _chat_chunks(client, server, logprobs=False)
    assert completion_tokens == MAX and _billed(server, tenant, rid) == MAX
    assert "".join(text for text, _ in plain) == whole
    if every == 1:
        assert len(plain) == MAX - silent
    else:
        assert MAX // 4 - 1 <= len(plain) <= MAX // 4 + 2  # fewer only for groups with no text


def test_stream_interval_is_a_setting_and_a_serve_flag():
    args = build_parser().parse_args(["serve", "--stream-interval", "4"])
    assert _settings(args).stream_interval == 4
    assert Settings().stream_interval == 1  # vLLM's default: a chunk per token
    with pytest.raises(ValueError, match="stream_interval"):
        Settings(stream_interval=0)
