"""OpenAI-compatible inference: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from loraplex.engine.outputs import RequestOutput
from loraplex.platform.api.choices import ChoiceDeltas, CompletionChoices, RunningUsage
from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError, error_body
from loraplex.platform.api.logprobs import token_text, vllm_prompt_logprobs
from loraplex.platform.api.prompt_batch import JobGroup, Tagged, run_all, start_jobs
from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.api.sse import MeteredEventStream
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.serving import FALLBACK_STOP, InferenceService, Job, StreamCut
from loraplex.platform.tool_calls import (
    ForcedCallStream,
    ToolCall,
    parse_tool_calls,
    scan_forced_calls,
)
from loraplex.platform.tool_stream import ToolCallStream

router = APIRouter(prefix="/v1", tags=["inference"], responses=API_ERRORS)
# JSON, or server-sent events with "stream": true.
_STREAMABLE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


@router.get("/models")
def list_models(state: StateDep, caller: CallerDep):
    """The base model and the caller's ready adapters as vLLM's model cards: the base has
    `root` = its name (never its folder: a server path) and `parent` null; an adapter has
    `parent` = the base and `root` = "sha256:<digest>", the content it was stored as. Our
    extension `architecture` says what every card runs on (see `architecture`)."""
    created = int(time.time())
    base = state.model_name
    limit = state.engine.config.max_model_len if state.engine is not None else None
    arch = architecture(state.spec)

    def card(id_: str, created: int, owned_by: str, root: str, parent: str | None) -> dict:
        return {"id": id_, "object": "model", "created": created, "owned_by": owned_by,
                "root": root, "parent": parent, "max_model_len": limit,
                "permission": [_permission(created)], "architecture": arch}  # fmt: skip

    data = [card(base, created, "loraplex", base, None)]
    with state.sessions() as session:
        # One card per name (its versions are in /v1/adapters; `name@vN` serves any of them),
        # dated by its first version, rooted in its newest.
        names: dict[str, list] = {}
        for a in crud.list_adapters(session, tenant_id=caller.tenant.id):
            if a.status == AdapterStatus.ready:
                names.setdefault(a.name, []).append(a)
        for name, versions in names.items():
            at = int(versions[0].created_at.timestamp())
            root = f"sha256:{versions[-1].sha256}"
            data.append(card(name, at, caller.tenant.name, root, base))
    return {"object": "list", "data": data}


def architecture(spec) -> dict | None:
    """The base model's family (its config's `model_type`, e.g. "qwen3_moe") and, for a
    mixture of experts, how many experts it routes among and how many each token takes
    (null for a dense model): what an adapter must have been trained on. Null while the
    model loads."""
    if spec is None:
        return None
    moe = None
    if spec.num_experts:
        moe = {"num_experts": spec.num_experts, "experts_per_token": spec.top_k}
    return {"family": spec.family, "mixture_of_experts": moe}


def _permission(created: int) -> dict:
    """vLLM's `ModelPermission`, which clients written against it may read: what a tenant's key
    may do with the model (sample and read logprobs; no fine-tuning through this API)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}  # fmt: skip


def _usage(job: Job) -> dict:
    return {
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": job.sent_tokens,
        "total_tokens": len(job.prompt_ids) + job.sent_tokens,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def _chat_logprobs(
    tok, out: RequestOutput, start: int, end: int, top: int, index: int = 0
) -> dict | None:
    lps = out.outputs[index].logprobs
    if lps is None:
        return None
    content = []
    for t, e in zip(out.outputs[index].token_ids[start:end], lps[start:end], strict=True):
        text = token_text(tok, t)
        alts = sorted(e.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            {
                "token": text,
                "logprob": e.get(t),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": token_text(tok, k),
                        "logprob": v,
                        "bytes": list(token_text(tok, k).encode()),
                    }
                    for k, v in alts
                ],
            }
        )
    return {"content": content}


async def _run_to_end(service: InferenceService, job: Job, request: Request) -> RequestOutput:
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
    await service.finish(job, "ok")
    return last


async def _sse(
    service: InferenceService,
    job: Job,
    first: RequestOutput | None,
    rest: AsyncIterator[RequestOutput],
    render,
    include_usage: bool,
):
    """Server-sent events with the tokens each carries; `MeteredEventStream` counts them into
    `job.sent_tokens` once delivered, so the usage chunk and the ledger say what was sent."""
    status = "aborted"
    try:
        outs = [first] if first is not None else []
        while True:
            for out in outs:
                chunk, n = render(out)  # a chunk, None, or a list of chunks
                for part in chunk if isinstance(chunk, list) else [chunk]:
                    yield (f"data: {json.dumps(part)}\n\n" if part is not None else ""), n
                    n = 0
            if outs and outs[-1].finished:
                break
            try:
                outs = [await rest.__anext__()]
            except StopAsyncIteration:
                break
        status = "ok"
        if include_usage:
            yield f"data: {json.dumps(render(None, usage=_usage(job))[0])}\n\n", 0
        yield "data: [DONE]\n\n", 0
    except APIError as e:
        status = "aborted" if isinstance(e, StreamCut) else "error"
        yield f"data: {json.dumps(error_body(e.status, e.message, e.code, e.param))}\n\n", 0
        yield "data: [DONE]\n\n", 0
    finally:
        await rest.aclose()
        await service.finish(job, status)


async def _start_stream(service, job):
    """Run until the first output so bad input still gets a proper HTTP error."""
    stream = service.outputs(job, stream=True)
    try:
        first = await stream.__anext__()
    except BaseException:
        await stream.aclose()
        await service.finish(job, "error")
        raise
    return first, stream


def _envelope(job: Job, obj: str, created: int, model: str) -> dict:
    return {"id": job.request_id, "object": obj, "created": created, "model": model}


async def _respond(service, job, request, body, render, obj: str, created: int, choice, extra=None):
    """A streamed (SSE) or whole answer, the same way for completions and chat; `extra(last)`:
    fields the whole answer carries beside its choices."""
    if body.stream:
        first, rest = await _start_stream(service, job)
        events = _sse(service, job, first, rest, render, body.include_usage)

        def delivered(n: int) -> None:
            job.sent_tokens += n

        async def closed() -> None:  # no-ops once the events' own `finally` has run
            await rest.aclose()
            await service.finish(job, "aborted")

        stall = service.state.settings.stream_stall_timeout_s
        return MeteredEventStream(events, delivered, closed, stall_timeout_s=stall)
    last = await _run_to_end(service, job, request)
    return {
        **_envelope(job, obj, created, body.model),
        "choices": [choice(last, i) for i in range(len(last.outputs))],
        "usage": _usage(job),
        **(extra(last) if extra else {}),
    }


def _encode(service: InferenceService, body: CompletionRequest, prompt) -> list[int]:
    ids = service.encode_prompt(prompt)  # (a 503 while the model loads)
    if isinstance(prompt, str) and not body.add_special_tokens:  # vLLM's: no BOS added
        ids = service.state.engine.tokenizer.encode(prompt, add_special_tokens=False)
    return body.truncated(ids)


@router.post("/completions", responses=_STREAMABLE)
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, caller: CallerDep
):
    service = InferenceService(state)
    body.check_supported()
    lora, adapter = await asyncio.to_thread(service.resolve_model, caller, body.model, body.user)
    prompts = body.prompts()
    if len(prompts) > 1:
        return await _completions_of_list(service, state, body, request, caller, prompts, lora,
                                          adapter)  # fmt: skip
    prompt_ids = _encode(service, body, prompts[0])
    params = body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs)
    job = await service.start(
        caller, "completions", body.model, prompt_ids, params, lora, adapter, body.user
    )
    choices = CompletionChoices(state.engine.tokenizer, body, prompts[0], prompt_ids, 0)
    created = int(time.time())
    running = RunningUsage(job) if body.continuous_usage else None

    def render(out: RequestOutput | None, usage: dict | None = None):
        base = _envelope(job, "text_completion", created, body.model)
        if out is None:
            return {**base, "choices": [], "usage": usage}, 0
        parts, n = choices.chunk(out)
        chunk = {**base, "choices": parts} if parts else None
        if running is not None:
            running.add(chunk, n)
        return chunk, n

    return await _respond(
        service, job, request, body, render, "text_completion", created, choices.whole
    )


async def _completions_of_list(service, state, body, request, caller, prompts, lora, adapter):
    """A list of prompts: an engine request and a usage record per prompt, started together;
    the answer's choices are prompt 0's n, then prompt 1's..., and its usage their sum."""
    ids = [_encode(service, body, p) for p in prompts]
    # Checked once for all (a bad value is the request's fault, not one prompt's).
    body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs)

    def start(prompt_ids: list[int]):  # params each: a request's logits processors are its own
        params = body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs)
        return service.start(
            caller, "completions", body.model, prompt_ids, params, lora, adapter, body.user
        )

    jobs = await start_jobs(service, ids, start)
    group = JobGroup(service, jobs, jobs[0].request_id)
    for p, job in enumerate(jobs):  # the usage records name the answer's id and the prompt
        job.request_id = f"{group.request_id}-{p}"
    tok = state.engine.tokenizer
    renders = [
        CompletionChoices(tok, body, prompt, prompt_ids, p * body.n)
        for p, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True))
    ]
    created = int(time.time())
    if not body.stream:
        lasts = await run_all(service, jobs, request, _run_to_end)
        usages = [_usage(job) for job in jobs]
        usage = {key: sum(u[key] for u in usages)
                 for key in ("prompt_tokens", "completion_tokens", "total_tokens")}  # fmt: skip
        usage["prompt_tokens_details"] = {"cached_tokens": sum(j.cached_tokens for j in jobs)}
        return {
            **_envelope(group, "text_completion", created, body.model),
            "choices": [
                r.whole(last, i)
                for r, last in zip(renders, lasts, strict=True)
                for i in range(len(last.outputs))
            ],  # fmt: skip
            "usage": usage,
        }
    running = RunningUsage(group) if body.continuous_usage else None

    def render(item: Tagged | None, usage: dict | None = None):
        base = _envelope(group, "text_completion", created, body.model)
        if item is None:
            return {**base, "choices": [], "usage": usage}, 0
        parts, n = renders[item.prompt].chunk(item.out)
        group.rendered(item.prompt, n)
        chunk = {**base, "choices": parts} if parts else None
        if running is not None:
            running.add(chunk, n)
        return chunk, n

    return await _respond(group, group, request, body, render, "text_completion", created, None)


@router.post("/chat/completions", responses=_STREAMABLE)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, caller: CallerDep
):
    service = InferenceService(state)
    body.check_supported()
    lora, adapter = await asyncio.to_thread(service.resolve_model, caller, body.model, body.user)
    tool_mode = body.tool_mode
    tools = body.tools if tool_mode else None
    text, fallback = service.chat_prompt(body.chat_messages(), tools)
    prompt_ids = body.truncated(service.encode_prompt(text, templated=True))
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, top if body.logprobs else None, body.prompt_logprobs)
    if fallback:  # the plain format must not run on into the next turn
        params.stop = [*params.stop, FALLBACK_STOP]
    job = await service.start(
        caller, "chat", body.model, prompt_ids, params, lora, adapter, body.user
    )
    tok = state.engine.tokenizer
    created = int(time.time())
    sent_role = False
    many = ChoiceDeltas()
    forced = ForcedCallStream() if tools and tool_mode != "auto" else None
    auto = ToolCallStream(tools) if tools and tool_mode == "auto" else None

    def render_chunk(out: RequestOutput | None, usage: dict | None = None):
        nonlocal sent_role
        base = _envelope(job, "chat.completion.chunk", created, body.model)
        if out is None:
            return {**base, "choices": [], "usage": usage}, 0
        if body.n > 1:
            choices, total = [], 0
            for i, text, start, n, finish in many.deltas(out):
                delta = {"role": "assistant", "content": text} if not start else {"content": text}
                lps = _chat_logprobs(tok, out, start, start + n, top, i)
                choices.append(
                    {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
                )
                total += n
            return ({**base, "choices": choices} if choices else None), total
        n = len(out.delta_token_ids)
        start = len(out.outputs[0].token_ids) - n
        if forced is not None:  # a forced call: streamed as it is written
            calls = forced.feed(out.delta_text)
            reason = out.outputs[0].finish_reason if out.finished else None
            if not calls and reason is None:
                return None, n
            delta: dict = {"content": None, "tool_calls": calls} if calls else {}
            if not sent_role:
                delta["role"], sent_role = "assistant", True
            if reason == "stop" and forced.calls:
                reason = "tool_calls"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**base, "choices": [choice]}, n
        if auto is not None:  # content as it is written, each call once it is decided
            content, calls = auto.feed(out.delta_text, final=out.finished)
            reason = out.outputs[0].finish_reason if out.finished else None
            if reason == "stop" and auto.calls:
                reason = "tool_calls"
            deltas = [{"content": content}] if content or not sent_role else []
            deltas += [{"tool_calls": [call]} for call in calls]  # a chunk each, as OpenAI's
            if not sent_role:
                deltas[0]["role"], sent_role = "assistant", True
            if reason is not None and not deltas:
                deltas = [{}]
            choices = [
                {"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
            ]
            if choices:
                choices[-1]["finish_reason"] = reason
            return [{**base, "choices": [c]} for c in choices] or None, n
        delta = {"content": out.delta_text}
        lps = _chat_logprobs(tok, out, start, start + n, top)
        if not sent_role:
            delta["role"], sent_role = "assistant", True
        elif not out.delta_text and not out.finished and lps is None:
            return None, n  # no text yet (part of a character); with logprobs it goes, as vLLM
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": lps,
            "finish_reason": out.outputs[0].finish_reason if out.finished else None,
        }
        return {**base, "choices": [choice]}, n

    running = RunningUsage(job) if body.continuous_usage else None

    def render(out: RequestOutput | None, usage: dict | None = None):
        chunk, n = render_chunk(out, usage)
        if running is not None and out is not None:
            running.add(chunk, n)
        return chunk, n

    def choice(last: RequestOutput, i: int) -> dict:
        out = last.outputs[i]
        message: dict = {"role": "assistant", "content": out.text}
        reason = out.finish_reason
        if tools:
            content, calls, reason = _answer(out.text, reason, tools, tool_mode)
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.public() for c in calls]
        return {
            "index": i,
            "message": message,
            "logprobs": _chat_logprobs(tok, last, 0, len(out.token_ids), top, i),
            "finish_reason": reason,
        }

    def prompt_logprobs(last: RequestOutput) -> dict:
        if body.prompt_logprobs is None:
            return {}
        k = body.prompt_logprobs  # vLLM's extension, beside the choices as vLLM's
        return {"prompt_logprobs": vllm_prompt_logprobs(tok, prompt_ids, last.prompt_logprobs, k)}

    return await _respond(
        service, job, request, body, render, "chat.completion", created, choice, prompt_logprobs
    )


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
