"""OpenAI's Batch API: jobs in the registry, run by every replica on the capacity interactive
traffic leaves free.

    POST /v1/batches ──▶ row "validating" ──▶ a replica's BatchRunner claims it (a lease)
        ──▶ "in_progress": lines run through the same route code as /v1/chat/completions
            and /v1/completions, in the engine's batch class (serving.BATCH_LINE), at most
            `batch_concurrency` at once; each finished line is a row of `batch_lines`
        ──▶ "finalizing": output and error files from those rows ──▶ "completed"
    cancel: "cancelling" ──▶ in-flight lines aborted ──▶ files of what finished ──▶ "cancelled"

Durability: a line's answer is written once (the row's primary key is (batch, line)), and a
line with no row has not finished, so a replica that dies mid-batch loses only its in-flight
lines. Its lease runs out (`batch_lease_s`) and any replica, or it once restarted, takes the
batch over and runs the lines with no row: none twice, none lost. A line's engine request id
is the same on every try, so the usage ledger keeps one record per line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.models import (
    ApiKey,
    Batch,
    BatchLine,
    BatchStatus,
    StoredFile,
    Tenant,
    utcnow,
)
from loraplex.platform.errors import APIError, error_body
from loraplex.platform.files import (
    BATCH_ENDPOINTS,
    BatchRequestLine,
    FileBlobs,
    create_file,
    get_file,
    parse_batch_input,
)
from loraplex.platform.serving import BATCH_LINE
from loraplex.platform.serving import BatchLine as LineContext
from loraplex.platform.state import Caller

log = logging.getLogger("loraplex.batches")
WINDOW = timedelta(hours=24)
ACTIVE = (
    BatchStatus.validating.value,
    BatchStatus.in_progress.value,
    BatchStatus.finalizing.value,
    BatchStatus.cancelling.value,
)
# Errors a line waits out instead of failing: the server is loading or going down, the
# adapter store hiccups, the tenant's per-minute limits (a batch has all day).
_RETRY_CODES = {"not_ready", "engine_unavailable", "adapter_unavailable", "store_unavailable"}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(max_length=40)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def _ts(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def line_counts(session: Session, batch_id: str) -> tuple[int, int]:
    """(completed, failed) lines of the batch."""
    rows = session.execute(
        select(BatchLine.ok, func.count())
        .where(BatchLine.batch_id == batch_id)
        .group_by(BatchLine.ok)
    ).all()
    counts = {bool(ok): n for ok, n in rows}
    return counts.get(True, 0), counts.get(False, 0)


def batch_public(session: Session, row: Batch) -> dict[str, Any]:
    completed, failed = line_counts(session, row.id)
    errors = None
    if row.errors:
        errors = {"object": "list", "data": row.errors}
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": errors,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": _ts(row.created_at),
        "in_progress_at": _ts(row.in_progress_at),
        "expires_at": _ts(row.expires_at),
        "finalizing_at": _ts(row.finalizing_at),
        "completed_at": _ts(row.completed_at),
        "failed_at": _ts(row.failed_at),
        "expired_at": _ts(row.expired_at),
        "cancelling_at": _ts(row.cancelling_at),
        "cancelled_at": _ts(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": completed, "failed": failed},
        "metadata": row.meta,
    }


def create_batch(session: Session, *, caller: Caller, body: BatchCreate) -> Batch:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise APIError(400, f"'endpoint' must be one of {list(BATCH_ENDPOINTS)}",
                       "invalid_value", "endpoint")  # fmt: skip
    if body.completion_window != "24h":
        raise APIError(400, "'completion_window' must be \"24h\"", "invalid_value",
                       "completion_window")  # fmt: skip
    meta = body.metadata
    if meta is not None and (
        len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items())
    ):
        raise APIError(400, "'metadata' holds at most 16 pairs, keys of at most 64 characters "
                       "and values of at most 512", "invalid_value", "metadata")  # fmt: skip
    try:
        source = get_file(session, tenant_id=caller.tenant.id, file_id=body.input_file_id)
    except APIError as e:
        e.param = "input_file_id"
        raise
    if source.purpose != "batch":
        raise APIError(400, f"file {source.id} has purpose '{source.purpose}', not 'batch'",
                       "invalid_value", "input_file_id")  # fmt: skip
    now = utcnow()
    row = Batch(
        id=new_batch_id(),
        tenant_id=caller.tenant.id,
        api_key_id=caller.key.id,
        input_file_id=source.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        meta=meta,
        status=BatchStatus.validating.value,
        total=0,
        created_at=now,
        expires_at=now + WINDOW,
    )
    session.add(row)
    session.commit()
    return row


def get_batch(session: Session, *, tenant_id: int, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id) if len(batch_id) <= 40 else None
    if row is None or row.tenant_id != tenant_id:
        raise APIError(404, f"No such Batch object: {batch_id[:80]}", "batch_not_found", "batch_id")
    return row


def cancel_batch(session: Session, *, tenant_id: int, batch_id: str) -> Batch:
    row = get_batch(session, tenant_id=tenant_id, batch_id=batch_id)
    if row.status in (BatchStatus.validating, BatchStatus.in_progress):
        session.execute(
            update(Batch)
            .where(Batch.id == row.id, Batch.status.in_(["validating", "in_progress"]))
            .values(status=BatchStatus.cancelling.value, cancelling_at=utcnow())
        )
        session.commit()
        session.refresh(row)
    elif row.status not in (BatchStatus.cancelling, BatchStatus.cancelled):
        raise APIError(409, f"Cannot cancel a batch with status '{row.status}'",
                       "batch_not_cancellable", "batch_id")  # fmt: skip
    return row


# ---------------------------------------------------------------- output lines


def _result_line(req: BatchRequestLine, status: int, request_id: str, body: dict) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": req.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def _error_line(req: BatchRequestLine, code: str, message: str) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": req.custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0] if e.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, str | int)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


class _Retry(Exception):
    def __init__(self, after_s: float):
        self.after_s = after_s


class _LineRequest:
    """What the routes ask of their HTTP request: whether its client left. A line's 'client'
    leaves when its batch stops (cancelled, expired, the server shutting down)."""

    def __init__(self, stop: asyncio.Event):
        self.stop = stop

    async def is_disconnected(self) -> bool:
        return self.stop.is_set()


# ---------------------------------------------------------------- the runner


class BatchRunner:
    """One per server: claims batches whose lease is free or ran out, runs up to
    `batch_max_active` of them, renews their leases while it does."""

    def __init__(self, state):
        self.state = state
        self.settings = state.settings
        self.owner = f"{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.tasks: dict[str, asyncio.Task] = {}

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=self.settings.batch_lease_s)

    def _ready(self) -> bool:
        st = self.state
        return st.engine is not None and st.accepting and st.engine_error is None

    async def run(self) -> None:
        while True:
            try:
                while self._ready() and len(self.tasks) < self.settings.batch_max_active:
                    batch_id = await asyncio.to_thread(self._claim)
                    if batch_id is None:
                        break
                    log.info("batch %s: taken by %s", batch_id, self.owner)
                    task = asyncio.create_task(self._run_batch(batch_id))
                    self.tasks[batch_id] = task
                    task.add_done_callback(lambda _, b=batch_id: self.tasks.pop(b, None))
            except Exception as e:  # the database away for a moment must not stop the loop
                log.warning("looking for batches to run failed: %s", e)
            await asyncio.sleep(self.settings.batch_poll_interval_s)

    async def stop(self) -> None:
        """Abort the in-flight lines and give the leases back (another replica goes on)."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _claim(self) -> str | None:
        now = utcnow()
        free = or_(Batch.runner.is_(None), Batch.lease_until < now)
        with self.state.sessions() as session:
            ids = session.scalars(
                select(Batch.id)
                .where(Batch.status.in_(ACTIVE), free)
                .order_by(Batch.created_at)
                .limit(8)
            ).all()
            for batch_id in ids:
                if batch_id in self.tasks:
                    continue
                # Compare and set: of replicas racing for it, one update matches.
                taken = session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id, Batch.status.in_(ACTIVE), free)
                    .values(runner=self.owner, lease_until=now + self.lease)
                )
                session.commit()
                if taken.rowcount == 1:
                    return batch_id
        return None

    def _renew(self, batch_id: str) -> tuple[str, datetime] | None:
        """Extend our lease; (status, expires_at), or None if the batch is no longer ours."""
        with self.state.sessions() as session:
            held = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.runner == self.owner)
                .values(lease_until=utcnow() + self.lease)
            )
            session.commit()
            if held.rowcount != 1:
                return None
            row = session.get(Batch, batch_id)
            return row.status, row.expires_at

    def _release(self, batch_id: str) -> None:
        with self.state.sessions() as session:
            session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.runner == self.owner)
                .values(runner=None, lease_until=None)
            )
            session.commit()

    def _set(self, batch_id: str, **values) -> bool:
        with self.state.sessions() as session:
            done = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.runner == self.owner)
                .values(**values)
            )
            session.commit()
            return done.rowcount == 1

    # -------------------------------------------------------------- one batch

    def _load(self, batch_id: str) -> tuple[str, str, Caller, str | None]:
        with self.state.sessions() as session:
            row = session.get(Batch, batch_id)
            status, endpoint = row.status, row.endpoint
            source = session.get(StoredFile, row.input_file_id)
            key = source.storage_key if source is not None else None
            return status, endpoint, _caller(session, row), key

    async def _run_batch(self, batch_id: str) -> None:
        stop = asyncio.Event()
        why: list[str] = []  # why it stopped: "cancel", "expired", "lost"
        beat = asyncio.create_task(self._heartbeat(batch_id, stop, why))
        try:
            status, endpoint, caller, key = await asyncio.to_thread(self._load, batch_id)
            if status in (BatchStatus.validating, BatchStatus.in_progress):
                lines = await self._input(batch_id, key, endpoint, status)
                if lines is None:
                    return  # failed validation (recorded)
                if status == BatchStatus.validating:
                    await asyncio.to_thread(self._set_in_progress, batch_id, len(lines))
                status = await asyncio.to_thread(self._status, batch_id)
                if status == BatchStatus.in_progress:
                    await self._run_lines(batch_id, caller, lines, stop)
                    status = await asyncio.to_thread(self._status, batch_id)
            if self.state.accepting and status in ACTIVE and "lost" not in why:
                await asyncio.to_thread(self._finalize, batch_id, "expired" in why, key)
        except Exception:
            log.exception("batch %s: the runner failed; another try after its lease", batch_id)
        finally:
            beat.cancel()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._release, batch_id)

    def _status(self, batch_id: str) -> str:
        with self.state.sessions() as session:
            return session.get(Batch, batch_id).status

    def _set_in_progress(self, batch_id: str, total: int) -> bool:
        with self.state.sessions() as session:
            done = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.status == BatchStatus.validating.value)
                .values(status=BatchStatus.in_progress.value, total=total, in_progress_at=utcnow())
            )
            session.commit()
            return done.rowcount == 1

    async def _input(self, batch_id, key, endpoint, status) -> list[BatchRequestLine] | None:
        """The batch's requests; None (and the batch failed) if its input cannot run."""
        error = None
        lines: list[BatchRequestLine] = []
        if key is None:
            error = {"code": "file_not_found", "message": "the input file was deleted",
                     "param": "input_file_id", "line": None}  # fmt: skip
        else:
            data = await asyncio.to_thread(FileBlobs(self.state.store).get, key)
            try:
                lines = parse_batch_input(data, max_lines=self.settings.batch_file_max_lines)
            except APIError as e:
                error = {"code": "invalid_file", "message": e.message, "param": "input_file_id",
                         "line": None}  # fmt: skip
            for i, req in enumerate(lines if error is None else []):
                if req.url != endpoint:
                    error = {"code": "invalid_url", "line": i + 1, "param": "url",
                             "message": f"line {i + 1}: url {req.url} is not the batch's "
                             f"endpoint {endpoint}"}  # fmt: skip
                    break
        if error is None:
            return lines
        if status == BatchStatus.validating:
            await asyncio.to_thread(
                self._set, batch_id, status=BatchStatus.failed.value, errors=[error],
                failed_at=utcnow(),
            )  # fmt: skip
            log.info("batch %s: failed validation: %s", batch_id, error["message"])
            return None
        raise RuntimeError(f"batch {batch_id}: its input became unreadable: {error['message']}")

    async def _heartbeat(self, batch_id: str, stop: asyncio.Event, why: list[str]) -> None:
        while True:
            await asyncio.sleep(self.settings.batch_lease_s / 3)
            try:
                held = await asyncio.to_thread(self._renew, batch_id)
            except Exception as e:  # a database outage: the lease may still hold; try again
                log.warning("batch %s: renewing its lease failed: %s", batch_id, e)
                continue
            if held is None:
                why.append("lost")
            elif held[0] == BatchStatus.cancelling:
                why.append("cancel")
            elif utcnow() >= held[1]:
                why.append("expired")
            if why:
                stop.set()
                return

    async def _run_lines(self, batch_id, caller, lines, stop: asyncio.Event) -> None:
        def finished() -> set[int]:
            with self.state.sessions() as session:
                return set(
                    session.scalars(select(BatchLine.line).where(BatchLine.batch_id == batch_id))
                )

        done = await asyncio.to_thread(finished)
        pending = asyncio.Queue()
        for req in lines:
            if req.line not in done:
                pending.put_nowait(req)
        if done:
            log.info("batch %s: resuming, %d of %d lines done", batch_id, len(done), len(lines))
        route = _route(self.state, lines[0].url) if lines else None

        async def worker() -> None:
            while not stop.is_set() and self.state.accepting:
                try:
                    req = pending.get_nowait()
                except asyncio.QueueEmpty:
                    return
                while not stop.is_set() and self.state.accepting:
                    try:
                        ok, result = await self._serve(batch_id, caller, req, route, stop)
                    except _Retry as r:
                        await _sleep_unless(stop, r.after_s)
                        continue
                    except asyncio.CancelledError:
                        if asyncio.current_task().cancelling():
                            raise
                        break  # the batch stopped while the line ran: it has no answer
                    await asyncio.to_thread(self._record, batch_id, req.line, ok, result)
                    break

        n = max(1, min(self.settings.batch_concurrency, pending.qsize()))
        await asyncio.gather(*(worker() for _ in range(n)))

    async def _serve(self, batch_id, caller, req, route, stop) -> tuple[bool, str]:
        from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest

        rid = f"{batch_id}-{req.line}"
        schema = ChatCompletionRequest if req.url == "/v1/chat/completions" else CompletionRequest
        try:
            body = schema.model_validate_json(json.dumps(req.body))
        except ValidationError as e:
            msg, param = _validation_message(e)
            return False, _result_line(req, 400, rid, error_body(400, msg, "invalid_value", param))
        token = BATCH_LINE.set(LineContext(request_id=rid))
        try:
            answer = await route(body, _LineRequest(stop), self.state, caller)
        except APIError as e:
            retry = e.headers.get("Retry-After")
            if e.code in _RETRY_CODES or (e.status == 429 and retry):
                raise _Retry(float(retry or 5)) from None
            body = error_body(e.status, e.message, e.code, e.param)
            return False, _result_line(req, e.status, rid, body)
        except Exception:  # our fault, not the line's: it fails alone, the batch goes on
            log.exception("batch %s: line %d failed", batch_id, req.line)
            msg = "the server failed on this request"
            return False, _result_line(req, 500, rid, error_body(500, msg, "internal_error"))
        finally:
            BATCH_LINE.reset(token)
        return True, _result_line(req, 200, answer["id"], answer)

    def _record(self, batch_id: str, line: int, ok: bool, result: str) -> None:
        with self.state.sessions() as session:
            dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
            # A line answered twice (two runners racing past a lease) keeps its first answer.
            session.execute(
                dialect.insert(BatchLine)
                .values(batch_id=batch_id, line=line, ok=ok, result=result, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=[BatchLine.batch_id, BatchLine.line])
            )
            session.commit()

    def _finalize(self, batch_id: str, expired: bool, key: str | None) -> None:
        """Write the output and error files from the finished lines, then the final state.
        Again after a crash: the files' ids are the batch's own, so a second try reuses them."""
        with self.state.sessions() as session:
            row = session.get(Batch, batch_id)
            if row.cancelling_at is not None:
                final = BatchStatus.cancelled
            elif expired or utcnow() >= row.expires_at:
                final = BatchStatus.expired
            else:
                final = BatchStatus.completed
        if not self._set(batch_id, status=BatchStatus.finalizing.value, finalizing_at=utcnow()):
            return
        blobs = FileBlobs(self.state.store)
        with self.state.sessions() as session:
            results = session.execute(
                select(BatchLine.line, BatchLine.ok, BatchLine.result)
                .where(BatchLine.batch_id == batch_id)
                .order_by(BatchLine.line)
            ).all()
            out = [r.result for r in results if r.ok]
            err = [r.result for r in results if not r.ok]
            if final == BatchStatus.expired and key is not None:
                answered = {r.line for r in results}
                lines = parse_batch_input(blobs.get(key), max_lines=1 << 30)
                err += [
                    _error_line(
                        req,
                        "batch_expired",
                        "This request could not be executed before the completion window expired.",
                    )  # fmt: skip
                    for req in lines
                    if req.line not in answered
                ]
            files = {}
            for kind, content in (("output", out), ("error", err)):
                if not content:
                    continue
                file_id = f"file-{batch_id.removeprefix('batch_')}-{kind[:3]}"
                if session.get(StoredFile, file_id) is None:
                    create_file(
                        session,
                        blobs,
                        tenant_id=row.tenant_id,
                        purpose="batch_output",
                        filename=f"{batch_id}_{kind}.jsonl",
                        data=("\n".join(content) + "\n").encode(),
                        file_id=file_id,
                    )
                files[kind] = file_id
        stamp = {
            BatchStatus.completed: "completed_at",
            BatchStatus.cancelled: "cancelled_at",
            BatchStatus.expired: "expired_at",
        }[final]
        self._set(
            batch_id,
            status=final.value,
            output_file_id=files.get("output"),
            error_file_id=files.get("error"),
            **{stamp: utcnow()},
        )
        log.info("batch %s: %s (%d answered, %d failed)", batch_id, final.value, len(out), len(err))


def _route(state, url: str):
    from loraplex.platform.api.routes import inference

    return inference.chat_completions if url == "/v1/chat/completions" else inference.completions


def _caller(session: Session, row: Batch) -> Caller:
    tenant = session.get(Tenant, row.tenant_id)
    key = session.get(ApiKey, row.api_key_id) if row.api_key_id is not None else None
    if key is None:  # the key that made the batch was deleted: usage names no key
        key = ApiKey(id=None, tenant_id=row.tenant_id, name="", prefix="", key_hash="")
    session.expunge_all()
    return Caller(tenant=tenant, key=key)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
