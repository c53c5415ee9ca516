"""One inference request end to end: resolve the model, check quotas, run, meter, answer.

Every request that passes authentication leaves exactly one usage record, with the tokens the
client was actually sent, whether it finished, was cancelled or failed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from loraplex.engine import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    AdapterError,
    AdapterUnavailable,
    BadRequestError,
    EngineBusy,
    EngineDeadError,
    EngineError,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)
from loraplex.platform import ledger, quotas, tracing, usage
from loraplex.platform.adapter_refs import AdapterRef, choose_version, parse_ref
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus, RequestClass
from loraplex.platform.errors import APIError
from loraplex.platform.openai.tool_calls import Tool, plain_tool_messages, template_messages
from loraplex.platform.state import AppState, Caller

FALLBACK_STOP = "\nUser:"
log = logging.getLogger("loraplex.requests")


def fallback_chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The documented plain chat format for base models without a chat template."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n\n")
        else:
            parts.append(f"{'User' if m['role'] != 'assistant' else 'Assistant'}: {m['content']}\n")
    parts.append("Assistant:")
    return "".join(parts)


def engine_adapter_id(digest: str) -> int:
    """The engine's id for an adapter: derived from its content, never from the row id.

    The engine caches weights (and prefix-cache KV) by this id, and SQLite gives a deleted
    row's id to the next insert, so a row id could make one tenant's new adapter run with
    another's old weights. Equal ids now mean equal bytes; 60 bits keep it a positive int64.
    """
    return int(digest[:15], 16) + 1


class StreamCut(APIError):
    """An operator ended the stream (key revoked or tenant suspended with streams cut)."""


@dataclass(frozen=True)
class BatchLine:
    """Set in `BATCH_LINE` while the batch runner (platform/batches.py) serves one line of a
    batch through the routes: the request runs in the engine's batch class and is billed as
    batch usage."""

    request_id: str  # the same on every try of the line: the ledger keeps one record of it


BATCH_LINE: ContextVar[BatchLine | None] = ContextVar("loraplex_batch_line", default=None)


@dataclass(frozen=True)
class AdapterUse:
    """The adapter version a request runs on: fixed when it starts, whatever aliases do."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@v{self.version}"


@dataclass
class Job:
    """What the route resolved; filled in while the request runs."""

    request_id: str
    caller: Caller
    route: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None
    adapter: AdapterUse | None
    estimate: int
    charged_at: float
    end_user: str | None = None  # the request's `user` field, kept in the usage record
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    submitted: float | None = None  # handed to the engine
    finish_reason: str | None = None
    # The latest engine output that carried the engine's times (`engine_times` reads them
    # once, when the request ends: not per streamed token).
    timed: RequestOutput | None = None
    adapter_tier: str | None = None  # tracing only: where the engine held the adapter
    sent_tokens: int = 0
    cached_tokens: int = 0
    status: str = "ok"
    recorded: bool = False
    request_class: str = RequestClass.interactive.value
    # The tenant's output guardrails (platform/guardrails/stream.py): engine outputs in,
    # the outputs the client may see out; None without output policies.
    output_filter: Callable[[AsyncIterator[RequestOutput]], AsyncIterator[RequestOutput]] | None = (
        None
    )

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.name if self.adapter else None

    @property
    def engine_times(self) -> tracing.EngineTimes | None:
        """The engine's own times of the request, where it sends them."""
        return None if self.timed is None else tracing.engine_times(self.timed)


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the last, with all their new text and ids."""
    if len(outs) == 1:
        return outs[0]
    return replace(
        outs[-1],
        delta_text="".join(o.delta_text for o in outs),
        delta_token_ids=[t for o in outs for t in o.delta_token_ids],
    )


def _adapter_tier(engine, lora_name: str) -> str:
    """Where the engine's latest stats snapshot has the adapter: in a device slot, in host
    memory, or neither (it loads from the local disk cache)."""
    stats = engine.stats()
    if lora_name in stats.resident_adapters:
        return "device"
    return "host" if lora_name in stats.host_adapters else "disk"


def _adapter_unavailable(e: Exception, job: Job) -> APIError:
    # Disk or store trouble: retrying may work. The cause names cache folders: the log gets
    # it, the tenant what to do.
    log.warning("adapter %s could not be read: %s", job.lora and job.lora.lora_name, e)
    msg = f"adapter '{job.model}' could not be read on this server; retry later"
    return APIError(503, msg, "adapter_unavailable", headers={"Retry-After": "5"})


def _engine_dead(e: Exception, job: Job) -> APIError:
    # The server exits (and is restarted) once requests end.
    msg = "the engine stopped while serving this request; retry on another replica"
    return APIError(503, msg, "engine_unavailable")


def _engine_busy(e: Exception | None, job: Job | None) -> APIError:
    # The engine reads no commands (stopped, stuck in a step): an admission limit, not a queue
    # that grows while every later route waits.
    msg = "the engine is not taking requests now; retry shortly"
    return APIError(503, msg, "engine_busy", headers={"Retry-After": "2"})


def _adapter_invalid(e: Exception, job: Job) -> APIError:
    if job.lora is not None and not os.path.isdir(job.lora.lora_path):
        # Its cached copy went between lookup and load (evicted by another process sharing
        # the cache folder): the adapter is fine, and the next try fetches it.
        msg = f"adapter '{job.model}' was removed from the disk cache meanwhile; retry"
        return APIError(503, msg, "adapter_unavailable", headers={"Retry-After": "1"})
    # The engine's reason names the cached folder: the log gets it whole; the tenant the
    # reason with server paths cut (the upload checks made it servable, so this is rare).
    log.warning("adapter %s cannot be served: %s", job.lora and job.lora.lora_name, e)
    reason = str(e).replace(job.lora.lora_path, "<adapter>") if job.lora else str(e)
    return APIError(422, f"adapter '{job.model}' cannot be served: {reason}", "invalid_adapter")


def _bad_request(e: Exception, job: Job) -> APIError:
    # The engine's checks that need the model; a chat request's prompt is its messages.
    param = getattr(e, "param", None)
    param = "messages" if param == "prompt" and job.route == "chat" else param
    return APIError(400, str(e), "invalid_value", param)


# The one table from the engine's error types (engine/errors.py) to what a client gets;
# the first entry the error is an instance of answers.
ENGINE_ERRORS: tuple[tuple[type[EngineError], Callable[[Exception, Job], APIError]], ...] = (
    (AdapterUnavailable, _adapter_unavailable),
    (EngineDeadError, _engine_dead),
    (EngineBusy, _engine_busy),
    (AdapterError, _adapter_invalid),
    (BadRequestError, _bad_request),
)


def engine_error(e: EngineError, job: Job) -> APIError:
    for kind, answer in ENGINE_ERRORS:
        if isinstance(e, kind):
            return answer(e, job)
    retry = getattr(e, "retry_after_s", None)  # a remote data plane's (platform/dataplane/)
    if retry is not None:
        log.warning("data plane unavailable: %s", e)  # names the servers: the log, not the tenant
        msg = "the data plane is not answering now; retry shortly"
        # engine_unavailable: a batch line that meets it is retried, never failed
        return APIError(503, msg, "engine_unavailable", headers={"Retry-After": str(retry)})
    return APIError(503, "the engine could not serve this request; retry", "engine_unavailable")


class InferenceService:
    def __init__(self, state: AppState):
        self.state = state

    # ---------------------------------------------------------------- preparation
    def _engine(self):
        engine = self.state.engine
        if self.state.engine_error is not None:
            raise APIError(503, self.state.engine_error, "engine_unavailable")
        if engine is None or not self.state.accepting:
            raise APIError(
                503,
                "the model is not ready (loading or shutting down)",
                "not_ready",
                headers={"Retry-After": "5"},
            )
        if not getattr(engine, "takes_requests", lambda: True)():  # before any charge
            raise _engine_busy(None, None)
        if self.state.engine_stalled_s() is not None:
            # Its requests may still finish; new ones would only wait behind them.
            msg = "the engine has not answered for a while; retry shortly"
            raise APIError(503, msg, "engine_unresponsive", headers={"Retry-After": "5"})
        return engine

    async def resolve(
        self, caller: Caller, model: str, user: str | None = None
    ) -> tuple[LoRARequest | None, AdapterUse | None]:
        """`resolve_model` from the event loop: on a worker thread where it reads the database
        (an adapter), on the loop for the base model, which reads nothing (a thread hop costs
        a short request more than the lookup; benchmarks/serving_overhead.py)."""
        if model == self.state.model_name:
            return self.resolve_model(caller, model, user)
        return await asyncio.to_thread(self.resolve_model, caller, model, user)

    def resolve_model(
        self, caller: Caller, model: str, user: str | None = None
    ) -> tuple[LoRARequest | None, AdapterUse | None]:
        """The adapter version `model` names for this tenant (`name`, `name@alias` or
        `name@vN`; see platform/adapter_refs.py); 404 if it has none by that name. `user`
        keeps one end user on one version of a split."""
        tracing.end_auth()
        if model == self.state.model_name:
            return None, None
        ref = parse_ref(model)
        with self.state.sessions() as session:
            row = None if ref is None else self._version_row(session, caller.tenant.id, ref, user)
            if row is None or row.status != AdapterStatus.ready:
                # The same answer whether or not another tenant has such an adapter.
                raise APIError(
                    404, f"The model '{model}' does not exist", "model_not_found", "model"
                )
            key, digest, use = row.storage_key, row.sha256, AdapterUse(row.name, row.version)
            crud.touch_adapter_used(session, adapter_id=row.id)
        traced = tracing.current() is not None
        try:
            if traced:
                fetched = time.monotonic()
                cached = (self.state.cache.dir / digest).is_dir()
            path = self.state.cache.get(key, digest)
            if traced:
                source = "disk" if cached else "store"
                tracing.phase("adapter_fetch", fetched, time.monotonic(), source=source)
        except Exception as e:  # store down or object gone: this request fails, not the server
            # The cause names store paths, buckets and endpoints: the operator's log gets it,
            # the tenant a message that says what to do, and which side failed.
            log.warning("adapter %s (tenant %s) could not be fetched: %s", key, caller.tenant.id, e)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                where = "this server's adapter cache is out of disk space"
            else:
                where = "it could not be fetched from the adapter store"
            msg = f"adapter '{model}' is unavailable: {where}; retry later"
            raise APIError(503, msg, "adapter_unavailable", headers={"Retry-After": "5"}) from None
        engine_name = f"{caller.tenant.id}/{use.name}@v{use.version}"
        lora = LoRARequest(engine_name, engine_adapter_id(digest), str(path))
        return lora, use

    @staticmethod
    def _version_row(session, tenant_id: int, ref: AdapterRef, user: str | None):
        """The row of the version `ref` reaches now: pinned, or drawn from its alias's split
        (an alias change is one committed row, so every replica's next request sees it)."""
        if ref.version is not None:
            return crud.get_adapter(
                session, tenant_id=tenant_id, name=ref.name, version=ref.version
            )
        alias = crud.get_alias(session, tenant_id=tenant_id, name=ref.name, alias=ref.alias)
        if alias is None:
            if ref.alias != crud.DEFAULT_ALIAS:
                return None
            # A name registered without its default alias (by hand): its newest version.
            return crud.get_adapter(session, tenant_id=tenant_id, name=ref.name)
        sticky = None if user is None else f"{tenant_id}/{ref.name}@{ref.alias}/{user}"
        version = choose_version(alias.weights, sticky_key=sticky)
        return crud.get_adapter(session, tenant_id=tenant_id, name=ref.name, version=version)

    def encode_prompt(self, prompt: str | list[int], *, templated: bool = False) -> list[int]:
        tracing.end_auth()
        tok = self._engine().tokenizer
        if isinstance(prompt, list):
            return prompt
        # A template that writes the BOS itself must not get a second one.
        bos = tok.bos_token
        add_special = not (templated and bos and prompt.startswith(bos))
        return tok.encode(prompt, add_special_tokens=add_special)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[Tool] | None = None
    ) -> tuple[str, bool]:
        """(prompt text, used the fallback format). A template that uses `tools` gets the tools
        and the tool messages as they are; others get them as plain turns (tool_calls.py)."""
        tok = self._engine().tokenizer
        template = tok.chat_template
        extra: dict[str, Any] = {}
        tooled = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if tooled and template and "tools" in template:
            messages = template_messages(messages)
            if tools:
                extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        elif tooled:
            messages = plain_tool_messages(messages, tools)
        if template:
            try:
                return tok.apply_chat_template(messages, add_generation_prompt=True, **extra), False
            except ValueError as e:
                raise APIError(400, str(e), "invalid_messages", "messages") from None
        return fallback_chat_prompt(messages), True

    async def start(
        self,
        caller: Caller,
        route: str,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None,
        adapter: AdapterUse | None,
        end_user: str | None = None,
    ) -> Job:
        tracing.end_auth()
        engine = self._engine()
        limit = engine.config.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the "
                f"prompt has {len(prompt_ids)}",
                "context_length_exceeded",
                "messages",
            )
        max_new = params.max_tokens if params.max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) + max_new > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; prompt "
                f"({len(prompt_ids)}) + max_tokens ({max_new}) exceeds it",
                "context_length_exceeded",
                "max_tokens",
            )
        estimate = len(prompt_ids) + max_new * params.num_samples  # n / best_of: each sample
        line = BATCH_LINE.get()
        request_class = RequestClass.batch if line else RequestClass.interactive
        charging = time.monotonic()
        decision = await asyncio.to_thread(self._charge, caller.tenant.id, estimate, request_class)
        tracing.phase(
            "quota", charging, time.monotonic(), allowed=decision.allowed, reserved=estimate
        )
        if not decision.allowed:
            usage.count_refusal(caller.tenant.id)
            headers = {"Retry-After": str(decision.retry_after_s)} if decision.retry_after_s else {}
            raise APIError(
                429, decision.reason or "quota exceeded", "rate_limit_exceeded", headers=headers
            )
        return Job(
            request_id=line.request_id
            if line
            else f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            request_class=request_class.value,
            caller=caller,
            route=route,
            model=model,
            prompt_ids=prompt_ids,
            params=params,
            lora=lora,
            adapter=adapter,
            end_user=end_user,
            estimate=estimate,
            charged_at=time.time(),
        )

    def _charge(self, tenant_id: int, tokens: int, request_class: RequestClass):
        with self.state.sessions() as session:
            return quotas.check_and_charge(
                session, tenant_id, tokens=tokens, request_class=request_class
            )

    # ---------------------------------------------------------------- running
    def outputs(self, job: Job, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """`engine_outputs`, through the job's output guardrails where it has any."""
        raw = self.engine_outputs(job, stream)
        return raw if job.output_filter is None else job.output_filter(raw)

    async def engine_outputs(self, job: Job, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """Engine outputs for the job. The caller reports delivery via `job.sent_tokens` and
        must call `finish(job)` in a `finally`: the job stays in `state.inflight` (what a
        shutdown's drain waits for) until its usage record is written. A `stream` pauses in
        the engine while `stream_window_tokens` of it wait unsent, and can be cut
        (`cut_streams`)."""
        engine = self._engine()
        self.state.inflight.add(job.request_id)
        if stream:
            self.state.streams[job.request_id] = job
        interval = self.state.settings.stream_interval if stream else 1
        held: list[RequestOutput] = []  # outputs not yet handed out (stream_interval > 1)
        handed = 0  # generated tokens handed out
        if job.lora is not None and tracing.current() is not None:
            job.adapter_tier = _adapter_tier(engine, job.lora.lora_name)
        job.submitted = time.monotonic()
        # The tenant's prefix-cache salt (platform/db/cache_salts.py), read with its row as the
        # request authenticated: a rotation reaches the next request on every replica.
        job.params.cache_salt = job.caller.tenant.cache_salt
        try:
            async for out in engine.generate(
                job.prompt_ids,
                job.params,
                job.lora,
                request_id=job.request_id,
                tenant=str(job.caller.tenant.id),
                weight=job.caller.tenant.weight,  # the registry's fair-share weight
                window=self.state.settings.stream_window_tokens if stream else None,
                priority=PRIORITY_BATCH
                if job.request_class == RequestClass.batch
                else PRIORITY_INTERACTIVE,
            ):
                if job.first_token is None and out.delta_token_ids:
                    job.first_token = time.monotonic()
                job.cached_tokens = out.num_cached_tokens
                if getattr(out, "metrics", None) is not None:
                    job.timed = out
                if out.finished and out.outputs:
                    job.finish_reason = out.outputs[0].finish_reason
                if interval > 1:
                    # vLLM's stream_interval: the first tokens at once, then every
                    # `interval` tokens, and the end.
                    held.append(out)
                    made = out.num_generated_tokens or len(out.outputs[0].token_ids)
                    if handed and made - handed < interval and not out.finished:
                        continue
                    out, held, handed = _merged(held), [], made
                yield out
        except EngineError as e:  # the engine's typed errors: ENGINE_ERRORS says the answer
            job.status = "error"
            raise engine_error(e, job) from None
        except ValueError as e:  # any other input the engine refused
            job.status = "error"
            raise APIError(400, str(e), "invalid_value") from None
        finally:
            self.state.streams.pop(job.request_id, None)

    def cut_streams(self, tenant_id: int, key_id: int | None = None) -> int:
        """End the running streams of a tenant (or of one of its keys) on this replica now:
        each gets an `error` event and `[DONE]`, billed for what it was sent. How many."""
        engine, cut = self.state.engine, 0
        for job in list(self.state.streams.values()):
            if job.caller.tenant.id != tenant_id or key_id not in (None, job.caller.key.id):
                continue
            what = "API key was revoked" if key_id is not None else "account was suspended"
            error = StreamCut(403, f"this stream was ended: the {what}", "stream_cut")
            if engine is not None and engine.cut(job.request_id, error):
                cut += 1
        return cut

    async def finish(self, job: Job, status: str | None = None) -> None:
        """Record usage once and give back the unused part of the quota reservation."""
        if job.recorded:
            return
        job.recorded = True
        status = status or job.status
        now = time.monotonic()
        m = self.state.metrics
        m.requests.labels(job.route, status).inc()
        if job.adapter is not None and m.adapter_names:
            m.version_requests.labels(job.adapter.name, f"v{job.adapter.version}").inc()
        m.prompt_tokens.inc(len(job.prompt_ids))
        m.completion_tokens.inc(job.sent_tokens)
        # Batch lines have a latency histogram of their own (metrics.py says why).
        interactive = job.request_class == RequestClass.interactive.value
        (m.latency if interactive else m.batch_latency).observe(now - job.started)
        ttft_ms = tpot_ms = None
        if job.first_token is not None:
            ttft_ms = (job.first_token - job.started) * 1000
            if interactive:
                m.ttft.observe(job.first_token - job.started)
            if job.sent_tokens > 1:
                tpot = (now - job.first_token) / (job.sent_tokens - 1)
                tpot_ms = tpot * 1000
                if interactive:
                    m.tpot.observe(tpot)
        actual = len(job.prompt_ids) + job.sent_tokens
        times = job.engine_times
        # One record: the usage row and the structured log line say the same thing.
        record = {
            "request_id": job.request_id,
            "tenant_id": job.caller.tenant.id,
            "model": job.model,
            "end_user": job.end_user,
            "status": status,
            "request_class": job.request_class,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": job.sent_tokens,
            "cached_tokens": job.cached_tokens,
            "queue_ms": times.queue_ms if times else None,
            "ttft_ms": ttft_ms,
            "tpot_ms": tpot_ms,
            "latency_ms": (now - job.started) * 1000,
        }
        if job.submitted is not None and tracing.current() is not None:
            tracing.record_job(
                tracing.JobTrace(
                    submitted=job.submitted,
                    first_token=job.first_token,
                    ended=now,
                    adapter=job.adapter_name,
                    adapter_version=job.adapter.version if job.adapter else None,
                    adapter_digest=os.path.basename(job.lora.lora_path) if job.lora else None,
                    adapter_tier=job.adapter_tier,
                    prompt_tokens=len(job.prompt_ids),
                    completion_tokens=job.sent_tokens,
                    finish_reason=job.finish_reason,
                    status=status,
                    engine=times,
                    tenant_id=job.caller.tenant.id,
                    model=job.model,
                    request_id=job.request_id,
                )
            )

        # Written now, or kept in the journal until the database answers (platform/ledger.py):
        # never an error here, so the answer (a stream's body) ends cleanly whatever happens.
        entry = ledger.usage_entry(
            {
                **record,
                "api_key_id": job.caller.key.id,
                "adapter_name": job.adapter_name,
                "adapter_version": job.adapter.version if job.adapter else None,
                "created_at": datetime.now(UTC),
            },
            tenant_id=job.caller.tenant.id,
            adjust=actual - job.estimate,
            charged_at=datetime.fromtimestamp(job.charged_at, UTC),
        )

        log.info(
            "request finished",
            extra={**record, "route": job.route, "latency_ms": round(record["latency_ms"], 1)},
        )
        # Shielded: a cancelled request (client gone) must still be billed. In flight until the
        # write is done, whether or not this task is cancelled meanwhile.
        written = asyncio.ensure_future(asyncio.to_thread(self.state.ledger.write, entry))
        written.add_done_callback(lambda _: self.state.inflight.discard(job.request_id))
        await asyncio.shield(written)

    async def release(self, job: Job) -> None:
        """Give back a started job's token reservation, with no usage record: for a job that
        never ran because another prompt of its request was refused before any ran."""
        if job.recorded:
            return
        job.recorded = True
        entry = ledger.release_entry(
            job.request_id,
            tenant_id=job.caller.tenant.id,
            adjust=-job.estimate,
            charged_at=datetime.fromtimestamp(job.charged_at, UTC),
        )
        await asyncio.to_thread(self.state.ledger.write, entry)
