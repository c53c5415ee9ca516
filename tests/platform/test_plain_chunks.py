"""A plain stream's events written straight from text (platform/openai/streaming.py,
`PlainChunks`) are byte for byte the events of the pydantic chunks they stand for."""

from __future__ import annotations

from loraplex.engine import RequestOutput
from loraplex.engine.outputs import CompletionOutput
from loraplex.platform.openai.chat import TextStream
from loraplex.platform.openai.completions import CompletionChoices, CompletionStream
from loraplex.platform.openai.protocol import CompletionRequest
from loraplex.platform.openai.streaming import Envelope, Rendered, event

PIECES = [("Hel", [1, 2], None), ("", [], None), ("", [3], None),
          ('lo "wörld" \\ \n\t☃', [4], None), ("\U0001f600 </s>", [5, 6], "length")]  # fmt: skip


def _outputs() -> list[RequestOutput]:
    outs, text, ids = [], "", []
    for i, (delta, new, finish) in enumerate(PIECES):
        text, ids = text + delta, ids + new
        done = i == len(PIECES) - 1
        outs.append(RequestOutput(
            request_id="cmpl-1", prompt="p", prompt_token_ids=[9], finished=done,
            outputs=[CompletionOutput(0, text, list(ids), finish)], delta_text=delta,
            delta_token_ids=list(new),
        ))  # fmt: skip
    return outs


def _events(echo: bool, plain: bool) -> list[tuple[str, int]]:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "Say \u00e9", "stream": True, "echo": echo}
    )
    envelope = Envelope("cmpl-1", "text_completion", 1700000000, "m/ünï")
    choices = CompletionChoices(None, body, "Say \u00e9", [9], 0)
    stream = CompletionStream(envelope, [choices], job=None, continuous_usage=False)
    if not plain:
        stream.plain = None  # the pydantic chunks' path
    got = []
    for out in _outputs():
        chunks, n = stream.chunks(out)
        assert all(isinstance(c, Rendered) == plain for c in chunks)
        got.append(([event(c) for c in chunks], n))
    return got


def test_plain_events_are_the_pydantic_chunks_bytes():
    for echo in (False, True):
        plain = _events(echo, plain=True)
        assert plain == _events(echo, plain=False)
        assert [n for _, n in plain] == [2, 0, 1, 1, 2]  # the tokens each output carries
        assert plain[1] == ([], 0)  # nothing new: no event


def _chat_events(plain: bool) -> list[tuple[str, int]]:
    envelope = Envelope("chatcmpl-1", "chat.completion.chunk", 1700000000, "m/ünï")
    stream = TextStream(envelope, None, tok=None, top=0, plain=plain)
    got = []
    for out in _outputs():
        chunks, n = stream.chunks(out)
        assert all(isinstance(c, Rendered) == plain for c in chunks)
        got.append(([event(c) for c in chunks], n))
    return got


def test_plain_chat_events_are_the_pydantic_chunks_bytes():
    plain = _chat_events(plain=True)
    assert plain == _chat_events(plain=False)
    assert [n for _, n in plain] == [2, 0, 1, 1, 2]
    assert '"role": "assistant"' in plain[0][0][0]  # with the first delta only
    assert not any('"role"' in e for events, _ in plain[1:] for e in events)
    assert plain[1] == ([], 0)
