"""/v1/chat/completions: the prompt from the messages (and tools), then the answer whole or as
chunks.

A stream is one of four kinds, each a class holding its own state: plain text (`TextStream`),
n > 1 samples (`SamplesStream`), a call forced by `tool_choice` streamed as it is written
(`ForcedCallsStream`), and `tool_choice: "auto"`, content as it is written and each call once
it is decided (`AutoToolsStream`). See platform/openai/tool_calls.py for the formats.
"""

from __future__ import annotations

import time

from fastapi import Request

from loraplex.engine import RequestOutput
from loraplex.platform.guardrails.hooks import guard_input, guard_output
from loraplex.platform.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from loraplex.platform.openai.protocol import ChatCompletionRequest
from loraplex.platform.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatToolCall,
    ChoiceDelta,
    SampleDelta,
    ToolCallDelta,
    Usage,
)
from loraplex.platform.openai.sse import MeteredEventStream
from loraplex.platform.openai.streaming import (
    AnswerStream,
    ChoiceDeltas,
    Envelope,
    PlainChatChunks,
    RunningUsage,
    run_to_end,
    usage_of,
)
from loraplex.platform.openai.tool_calls import (
    ForcedCallStream,
    ToolCall,
    parse_tool_calls,
    scan_forced_calls,
)
from loraplex.platform.openai.tool_stream import ToolCallStream
from loraplex.platform.serving import FALLBACK_STOP, InferenceService


async def serve_chat(
    body: ChatCompletionRequest, request: Request, state, caller
) -> ChatCompletion | MeteredEventStream:
    service = InferenceService(state)
    body.check_supported()
    lora, adapter = await service.resolve(caller, body.model, body.user)
    mode = body.tool_mode
    tools = body.tools if mode else None
    text, fallback = service.chat_prompt(body.chat_messages(), tools)
    (text,), gate = await guard_input(
        state, caller, "chat", [text], stream=body.stream, n=body.n, logprobs=body.logprobs
    )
    prompt_ids = body.truncated(service.encode_prompt(text, templated=True))
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, top if body.logprobs else None, body.prompt_logprobs)
    if fallback:  # the plain format must not run on into the next turn
        params.stop = [*params.stop, FALLBACK_STOP]
    job = await service.start(
        caller, "chat", body.model, prompt_ids, params, lora, adapter, body.user
    )
    await guard_output(gate, [job], job.request_id)
    tok = state.engine.tokenizer
    created = int(time.time())
    if body.stream:
        envelope = Envelope(job.request_id, "chat.completion.chunk", created, body.model)
        running = RunningUsage(job) if body.continuous_usage else None
        if body.n > 1:
            stream: ChatStream = SamplesStream(envelope, running, tok, top)
        elif tools and mode != "auto":
            stream = ForcedCallsStream(envelope, running)
        elif tools:
            stream = AutoToolsStream(envelope, running, tools)
        else:
            plain = running is None and not body.logprobs  # its events written directly
            stream = TextStream(envelope, running, tok, top, plain)
        return await AnswerStream(service, job, stream, body.include_usage).start()
    last = await run_to_end(service, job, request)
    extra = {}
    if body.prompt_logprobs is not None:  # vLLM's extension, beside the choices as vLLM's
        k = body.prompt_logprobs
        extra["prompt_logprobs"] = vllm_prompt_logprobs(tok, prompt_ids, last.prompt_logprobs, k)
    return ChatCompletion(
        id=job.request_id, object="chat.completion", created=created, model=body.model,
        choices=[_choice(tok, last, i, top, tools, mode) for i in range(len(last.outputs))],
        usage=usage_of(job), **extra,
    )  # fmt: skip


def _choice(tok, last: RequestOutput, i: int, top: int, tools, mode) -> ChatChoice:
    out = last.outputs[i]
    content, reason, calls = out.text, out.finish_reason, []
    if tools:
        content, calls, reason = _answer(out.text, reason, tools, mode)
    message = AssistantMessage(role="assistant", content=content)
    if calls:
        message = AssistantMessage(
            role="assistant", content=content,
            tool_calls=[ChatToolCall.model_validate(c.public()) for c in calls],
        )  # fmt: skip
    lps = chat_logprobs(tok, last, 0, len(out.token_ids), top, i)
    return ChatChoice(index=i, message=message, logprobs=lps, finish_reason=reason)


def _answer(text: str, reason: str | None, tools, mode: str) -> tuple[str | None, list, str]:
    """(content, tool calls, finish_reason) of a finished answer to a request with tools."""
    if mode == "auto":
        content, calls = parse_tool_calls(text, tools)
    else:
        # The calls as the grammar wrote them, as they were streamed: one cut by max_tokens
        # keeps its partial arguments, with finish_reason "length" (OpenAI's API does so too).
        content = None
        calls = [ToolCall(name, args) for name, args, _ in scan_forced_calls(text)]
    return content, calls, ("tool_calls" if calls and reason == "stop" else reason)


def _finish(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


class ChatStream:
    """What the chat streams share: the chunks' envelope, the running usage (vLLM's
    continuous_usage_stats) and whether the role has gone out (with the first delta)."""

    def __init__(self, envelope: Envelope, running: RunningUsage | None) -> None:
        self.envelope, self.running = envelope, running
        self.sent_role = False

    def chunks(self, out: RequestOutput) -> tuple[list[ChatCompletionChunk], int]:
        chunks, n = self.render(out)
        if self.running is not None:
            self.running.add(chunks, n)
        return chunks, n

    def render(self, out: RequestOutput) -> tuple[list[ChatCompletionChunk], int]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.envelope.fields(), choices=[], usage=usage)

    def chunk(self, *choices: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.envelope.fields(), choices=list(choices))

    def role(self) -> dict:
        """The role for the first delta (its last key, as it has always been sent)."""
        if self.sent_role:
            return {}
        self.sent_role = True
        return {"role": "assistant"}


class TextStream(ChatStream):
    def __init__(self, envelope, running, tok, top: int, plain: bool = False) -> None:
        super().__init__(envelope, running)
        self.tok, self.top = tok, top
        self.plain = PlainChatChunks(envelope) if plain else None

    def render(self, out):
        n = len(out.delta_token_ids)
        if self.plain is not None:  # what the pydantic chunk below makes of it, as text
            first = not self.sent_role
            if not first and not out.delta_text and not out.finished:
                return [], n
            self.sent_role = True
            return [self.plain.event(out.delta_text, first, _finish(out))], n
        start = len(out.outputs[0].token_ids) - n
        lps = chat_logprobs(self.tok, out, start, start + n, self.top)
        first = not self.sent_role
        if not first and not out.delta_text and not out.finished and lps is None:
            return [], n  # no text yet (part of a character); with logprobs it goes, as vLLM
        delta = ChoiceDelta(content=out.delta_text, **self.role())
        return [self.chunk(ChatChunkChoice(index=0, delta=delta, logprobs=lps,
                                           finish_reason=_finish(out)))], n  # fmt: skip


class SamplesStream(ChatStream):
    """n > 1: each choice's new text since its previous chunk, the choices side by side."""

    def __init__(self, envelope, running, tok, top: int) -> None:
        super().__init__(envelope, running)
        self.tok, self.top, self.many = tok, top, ChoiceDeltas()

    def render(self, out):
        choices, total = [], 0
        for i, text, start, n, finish in self.many.deltas(out):
            role = {} if start else {"role": "assistant"}  # with a choice's first tokens
            delta = SampleDelta(**role, content=text)
            lps = chat_logprobs(self.tok, out, start, start + n, self.top, i)
            choices.append(ChatChunkChoice(index=i, delta=delta, logprobs=lps,
                                           finish_reason=finish))  # fmt: skip
            total += n
        return ([self.chunk(*choices)] if choices else []), total


class ForcedCallsStream(ChatStream):
    """A call forced by tool_choice, streamed as it is written."""

    def __init__(self, envelope, running) -> None:
        super().__init__(envelope, running)
        self.forced = ForcedCallStream()

    def render(self, out):
        n = len(out.delta_token_ids)
        calls = self.forced.feed(out.delta_text)
        reason = _finish(out)
        if not calls and reason is None:
            return [], n
        delta = {"content": None, "tool_calls": _deltas(calls)} if calls else {}
        if reason == "stop" and self.forced.calls:
            reason = "tool_calls"
        choice = ChatChunkChoice(index=0, delta=ChoiceDelta(**delta, **self.role()),
                                 logprobs=None, finish_reason=reason)  # fmt: skip
        return [self.chunk(choice)], n


class AutoToolsStream(ChatStream):
    """tool_choice "auto": content as it is written, each call once it is decided, a chunk
    each, as OpenAI's."""

    def __init__(self, envelope, running, tools) -> None:
        super().__init__(envelope, running)
        self.auto = ToolCallStream(tools)

    def render(self, out):
        n = len(out.delta_token_ids)
        content, calls = self.auto.feed(out.delta_text, final=out.finished)
        reason = _finish(out)
        if reason == "stop" and self.auto.calls:
            reason = "tool_calls"
        deltas = [{"content": content}] if content or not self.sent_role else []
        deltas += [{"tool_calls": _deltas([call])} for call in calls]
        if deltas:
            deltas[0].update(self.role())
        if reason is not None and not deltas:
            deltas = [{}]
        last = len(deltas) - 1
        choices = [
            ChatChunkChoice(index=0, delta=ChoiceDelta(**d), logprobs=None,
                            finish_reason=reason if k == last else None)
            for k, d in enumerate(deltas)
        ]  # fmt: skip
        return [self.chunk(c) for c in choices], n


def _deltas(calls: list[dict]) -> list[ToolCallDelta]:
    return [ToolCallDelta.model_validate(c) for c in calls]
