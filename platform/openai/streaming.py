"""What completions and chat serve alike: running a request to its end or streaming it as
server-sent events, usage, and the per-choice bookkeeping of n > 1 streams.

A stream's state lives in a renderer object (`CompletionStream`, the chat streams): it turns
each engine output into the chunks to send and the tokens they carry. `AnswerStream` sends
them: each chunk serialized once, its tokens counted into the job's `sent_tokens` once
delivered (`MeteredEventStream`), so the usage chunk and the ledger say what was sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from pydantic import BaseModel

from loraplex.engine import RequestOutput
from loraplex.platform.api.errors import APIError, error_body
from loraplex.platform.openai.bill_on_send import bill_on_send
from loraplex.platform.openai.responses import PromptTokensDetails, Usage
from loraplex.platform.openai.sse import MeteredEventStream
from loraplex.platform.serving import InferenceService, Job, StreamCut


@dataclass(frozen=True)
class Envelope:
    """The fields every answer and chunk of one request starts with."""

    id: str
    object: str
    created: int
    model: str

    def fields(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}


def usage_of(job: Job) -> Usage:
    return Usage(
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=job.sent_tokens,
        total_tokens=len(job.prompt_ids) + job.sent_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=job.cached_tokens),
    )


class ChoiceDeltas:
    """Streaming with n > 1: each choice's new text and tokens since its previous chunk (an
    unfinished sample's text only grows: the engine holds back possible stop strings)."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens) sent
        self.done: set[int] = set()

    def deltas(self, out: RequestOutput):
        """(index, new text, first new token, new tokens, finish_reason) per changed choice."""
        for c in out.outputs:
            chars, toks = self.sent.get(c.index, (0, 0))
            text, new = c.text[chars:], len(c.token_ids) - toks
            finish = c.finish_reason if c.index not in self.done else None
            if not text and not new and finish is None and c.index in self.sent:
                continue
            self.sent[c.index] = (len(c.text), len(c.token_ids))
            if finish is not None:
                self.done.add(c.index)
            yield c.index, text, toks, new, finish


class RunningUsage:
    """vLLM's `stream_options.continuous_usage_stats`: each chunk's usage, as of that chunk."""

    def __init__(self, job) -> None:
        self.job, self.completion = job, 0

    def add(self, chunks: list, tokens: int) -> None:
        self.completion += tokens
        prompt = len(self.job.prompt_ids)
        for chunk in chunks:
            chunk.usage = Usage(prompt_tokens=prompt, completion_tokens=self.completion,
                                total_tokens=prompt + self.completion)  # fmt: skip


class Renderer(Protocol):
    """A stream's state: the chunks each output brings, and the closing usage chunk."""

    def chunks(self, item) -> tuple[list[BaseModel | Rendered], int]: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...


class Rendered(str):
    """A chunk a renderer wrote as its event's text already (`PlainChunks`)."""


def event(chunk: BaseModel | Rendered) -> str:
    if isinstance(chunk, Rendered):
        return chunk
    # json.dumps of the dump, not model_dump_json: the same bytes as the answers always had
    # (Python's float spelling, ASCII escapes, ", " separators).
    return f"data: {json.dumps(chunk.model_dump())}\n\n"


class PlainChunks:
    """The events of a stream whose chunks are one choice of text each (no logprobs, no
    running usage): each written straight from its text and finish, around the request's
    fixed head, in the bytes `event` writes for the model. Building the pydantic chunk and
    dumping it cost most of a streamed token's time in the server (benchmarks/
    serving_overhead.py); this costs one string escape."""

    def __init__(self, envelope: Envelope, index: int) -> None:
        empty = json.dumps({**envelope.fields(), "choices": [{"index": index, "text": ""}]})
        self.head = "data: " + empty[: -len('""}]}')]  # up to the text's opening quote

    def event(self, text: str, finish_reason: str | None) -> Rendered:
        finish = "null" if finish_reason is None else _escaped(finish_reason)
        return Rendered(
            f'{self.head}{_escaped(text)}, "logprobs": null, "finish_reason": {finish}}}]}}\n\n'
        )


class PlainChatChunks:
    """`PlainChunks` for a chat stream of one choice of content (no logprobs, no running
    usage, no tools): the delta's content, and the role after it in the first."""

    def __init__(self, envelope: Envelope) -> None:
        empty = json.dumps(
            {**envelope.fields(), "choices": [{"index": 0, "delta": {"content": ""}}]}
        )
        self.head = "data: " + empty[: -len('""}}]}')]  # up to the content's opening quote

    def event(self, content: str, first: bool, finish_reason: str | None) -> Rendered:
        role = ', "role": "assistant"' if first else ""
        finish = "null" if finish_reason is None else _escaped(finish_reason)
        return Rendered(
            f'{self.head}{_escaped(content)}{role}}}, "logprobs": null, '
            f'"finish_reason": {finish}}}]}}\n\n'
        )


_escaped = json.encoder.encode_basestring_ascii  # json.dumps of a str (ensure_ascii)


async def run_to_end(service: InferenceService, job: Job, request: Request) -> RequestOutput:
    """Collect a non-streamed request, aborting it if the client goes away."""

    async def consume():
        last = None
        async for out in service.outputs(job):
            last = out
        return last

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                break
        last = await task
    except asyncio.CancelledError:  # the client went, or this was cancelled (a sibling failed)
        task.cancel()
        await service.finish(job, "aborted")
        raise
    except BaseException:
        await service.finish(job, "error")
        raise
    # Every sample's tokens: best_of also bills the samples it did not return.
    job.sent_tokens = last.num_generated_tokens or sum(len(c.token_ids) for c in last.outputs)
    # Billed as its body is handed to the connection, open or not (bill_on_send.py): the poll
    # above only stops generating for a client that left.
    if not bill_on_send(request, service, job):
        await service.finish(job, "ok")
    return last


class AnswerStream:
    """One streamed answer: its events, and the job's billing as they are delivered.

    `service` and `job` may be a `JobGroup` (a list of prompts), which stands in for both."""

    def __init__(self, service, job, renderer: Renderer, include_usage: bool) -> None:
        self.service, self.job, self.renderer = service, job, renderer
        self.include_usage = include_usage
        self.rest: AsyncIterator[RequestOutput] | None = None
        self.now = False  # the next event comes without waiting (MeteredEventStream's ready)
        self.queued = None  # the engine's count of this job's outputs waiting, where it has one
        one_job = isinstance(service, InferenceService)  # not a list of prompts' JobGroup
        if one_job and job.output_filter is None and service.state.settings.stream_interval == 1:
            # Else outputs waiting in the engine's queue may still be held back (merged,
            # filtered): gathering events behind them could delay what is ready now.
            self.queued = getattr(service.state.engine, "queued", None)

    async def start(self) -> MeteredEventStream:
        """Run until the first output so bad input still gets a proper HTTP error."""
        self.rest = self.service.outputs(self.job, stream=True)
        try:
            first = await self.rest.__anext__()
        except BaseException:
            await self.rest.aclose()
            await self.service.finish(self.job, "error")
            raise
        stall = self.service.state.settings.stream_stall_timeout_s
        return MeteredEventStream(
            self.events(first), self.delivered, self.closed, stall_timeout_s=stall,
            ready=None if self.queued is None else self.ready,
        )  # fmt: skip

    def ready(self) -> bool:
        return self.now

    def delivered(self, tokens: int) -> None:
        self.job.sent_tokens += tokens

    async def closed(self) -> None:  # no-ops once the events' own `finally` has run
        await self.rest.aclose()
        await self.service.finish(self.job, "aborted")

    async def events(self, first):
        """`(event text, tokens)` pairs: each output's chunks (the tokens go with the first; an
        output without a chunk carries its tokens over as ""), the usage chunk, [DONE]."""
        status = "aborted"
        try:
            out = first
            while True:
                chunks, n = self.renderer.chunks(out)
                # Ready at once: the output's next chunk, an output already waiting in the
                # engine's queue, or [DONE] after the last; not the usage chunk, which must
                # count what was sent before it (`delivered`), so what precedes it is written.
                waiting = (self.queued is not None and self.queued(self.job.request_id) > 0) or (
                    out.finished and not self.include_usage
                )
                if not chunks:
                    self.now = waiting
                    yield "", n
                for i, chunk in enumerate(chunks):
                    self.now = waiting or i + 1 < len(chunks)
                    yield event(chunk), n
                    n = 0
                if out.finished:
                    break
                try:
                    out = await self.rest.__anext__()
                except StopAsyncIteration:
                    break
            status = "ok"
            self.now = True  # the usage chunk and [DONE] follow at once
            if self.include_usage:
                yield event(self.renderer.usage_chunk(usage_of(self.job))), 0
            # Not ready after [DONE]: everything gathered is written (and `delivered`) before
            # this generator ends, whose `finally` bills what was delivered.
            self.now = False
            yield "data: [DONE]\n\n", 0
        except APIError as e:
            status = "aborted" if isinstance(e, StreamCut) else "error"
            self.now = True
            yield f"data: {json.dumps(error_body(e.status, e.message, e.code, e.param))}\n\n", 0
            self.now = False
            yield "data: [DONE]\n\n", 0
        finally:
            await self.rest.aclose()
            await self.service.finish(self.job, status)
