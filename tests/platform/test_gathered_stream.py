"""A stream its server fell behind on (every output already queued) goes out in gathered
writes (platform/openai/sse.py): still one event per token, the usage chunk and the ledger
counting every token sent, none twice."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from loraplex.engine import RequestOutput
from loraplex.engine.outputs import CompletionOutput
from loraplex.platform.openai.completions import CompletionChoices, CompletionStream
from loraplex.platform.openai.protocol import CompletionRequest
from loraplex.platform.openai.streaming import AnswerStream, Envelope
from loraplex.platform.serving import InferenceService

TOKENS = 12


class Lagging(InferenceService):
    """Every output of the request waiting already: the engine ran ahead of this server."""

    def __init__(self) -> None:
        self.left = TOKENS
        engine = SimpleNamespace(queued=lambda rid: self.left)
        settings = SimpleNamespace(stream_interval=1, stream_stall_timeout_s=None)
        super().__init__(SimpleNamespace(engine=engine, settings=settings))
        self.billed: list[tuple[int, str]] = []

    async def outputs(self, job, stream: bool = False):
        text = ""
        for i in range(TOKENS):
            self.left -= 1
            text += f"t{i} "
            done = i == TOKENS - 1
            yield RequestOutput(
                request_id=job.request_id, prompt=None, prompt_token_ids=[1], finished=done,
                outputs=[CompletionOutput(0, text, list(range(i + 1)), "length" if done else None)],
                delta_text=f"t{i} ", delta_token_ids=[i],
            )  # fmt: skip

    async def finish(self, job, status: str | None = None) -> None:
        if not job.recorded:
            job.recorded = True
            self.billed.append((job.sent_tokens, status))


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_lagging_stream_is_gathered_and_every_token_billed_once(include_usage):
    service = Lagging()
    job = SimpleNamespace(request_id="cmpl-1", prompt_ids=[1], sent_tokens=0, cached_tokens=0,
                          output_filter=None, recorded=False)  # fmt: skip
    body = CompletionRequest.model_validate({"model": "m", "prompt": "p", "stream": True})
    choices = CompletionChoices(None, body, "p", [1], 0)
    envelope = Envelope(job.request_id, "text_completion", 0, "m")
    renderer = CompletionStream(envelope, [choices], job, continuous_usage=False)
    bodies: list[bytes] = []

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    async def receive():
        await asyncio.sleep(3600)

    async def run():
        response = await AnswerStream(service, job, renderer, include_usage).start()
        await response({"type": "http"}, receive, send)

    asyncio.run(run())
    events = [e for b in bodies for e in b.decode().split("\n\n") if e]
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == [f"t{i} " for i in range(TOKENS)] and events[-1] == "data: [DONE]"
    assert len([b for b in bodies if b]) < len(events)  # gathered: fewer writes than events
    assert service.billed == [(TOKENS, "ok")]  # billed once, every token sent
    if include_usage:
        assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
