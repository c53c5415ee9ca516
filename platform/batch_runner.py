"""The batch runner: one per server, it claims batches by a lease in the database and runs
their lines through the interactive routes' own code, in the engine's batch class (see
platform/batches.py for the whole flow and why nothing is lost or run twice)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from loraplex.platform import quotas
from loraplex.platform.batches import (
    ACTIVE,
    final_state,
    record_line,
    result_line,
    validation_message,
    write_result_files,
)
from loraplex.platform.db.health import note_outage
from loraplex.platform.db.models import (
    ApiKey,
    Batch,
    BatchLine,
    BatchStatus,
    StoredFile,
    Tenant,
    TenantStatus,
    utcnow,
)
from loraplex.platform.errors import APIError, error_body
from loraplex.platform.files import BatchRequestLine, FileBlobs, parse_batch_input
from loraplex.platform.serving import BATCH_LINE
from loraplex.platform.serving import BatchLine as LineContext
from loraplex.platform.state import Caller

log = logging.getLogger("loraplex.batches")
# Errors a line waits out instead of failing: the server is loading or going down, the
# adapter store hiccups, the tenant's per-minute limits (a batch has all day).
_RETRY_CODES = {"not_ready", "engine_unavailable", "adapter_unavailable", "store_unavailable"}


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
        self.draining = False  # shutting down: no new lines, the running ones finish

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=self.settings.batch_lease_s)

    def _going(self) -> bool:
        return self.state.accepting and not self.draining

    def _ready(self) -> bool:
        st = self.state
        return st.engine is not None and self._going() and st.engine_error is None

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
                if not note_outage(self.state, e):  # an outage is logged once, not each turn
                    log.warning("looking for batches to run failed: %s", e)
            await asyncio.sleep(self.settings.batch_poll_interval_s)

    async def stop(self) -> None:
        """Start no more lines, let the running ones finish and be recorded (for up to
        `shutdown_grace_s`), abort the rest, and give the leases back (another replica goes
        on). A line aborted here keeps its usage record of what it was sent, under the id
        its next try uses: so the rare line cut by a shutdown is billed short, never twice."""
        self.draining = True
        tasks = list(self.tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _claim(self) -> str | None:
        now = utcnow()
        free = or_(Batch.runner.is_(None), Batch.lease_until < now)
        with self.state.sessions() as session:
            ids = session.scalars(
                select(Batch.id)
                .join(Tenant, Tenant.id == Batch.tenant_id)
                .where(Batch.status.in_(ACTIVE), free, Tenant.status == TenantStatus.active.value)
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

    def _renew(self, batch_id: str) -> tuple[str, datetime, str] | None:
        """Extend our lease; (status, expires_at, its tenant's status), or None if the batch
        is no longer ours."""
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
            return row.status, row.expires_at, session.get(Tenant, row.tenant_id).status

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
            if self._going() and status in ACTIVE and not {"lost", "suspended"} & set(why):
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
            # Renewed every third of the lease, and at least every 2 s: the beat is also how a
            # cancel reaches the running lines.
            await asyncio.sleep(min(self.settings.batch_lease_s / 3, 2.0))
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
            elif held[2] != TenantStatus.active:
                why.append("suspended")  # it waits, unclaimed, until the tenant is active
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
            while not stop.is_set() and self._going():
                try:
                    req = pending.get_nowait()
                except asyncio.QueueEmpty:
                    return
                while not stop.is_set() and self._going():
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
        async with asyncio.TaskGroup() as group:  # one worker failing stops the others
            for _ in range(n):
                group.create_task(worker())

    async def _serve(self, batch_id, caller, req, route, stop) -> tuple[bool, str]:
        from loraplex.platform.openai.protocol import ChatCompletionRequest, CompletionRequest

        rid = f"{batch_id}-{req.line}"
        schema = ChatCompletionRequest if req.url == "/v1/chat/completions" else CompletionRequest
        try:
            body = schema.model_validate_json(json.dumps(req.body))
        except ValidationError as e:
            msg, param = validation_message(e)
            return False, result_line(req, 400, rid, error_body(400, msg, "invalid_value", param))
        # The tenant's own Batch API budget spent: the line waits for next month (or for
        # the batch to expire), as it waits out a per-minute limit.
        budget = await asyncio.to_thread(self._batch_budget, caller.tenant.id)
        if not budget.allowed:
            raise _Retry(float(budget.retry_after_s or 60))
        token = BATCH_LINE.set(LineContext(request_id=rid))
        try:
            answer = await route(body, _LineRequest(stop), self.state, caller)
        except APIError as e:
            retry = e.headers.get("Retry-After")
            if e.code in _RETRY_CODES or (e.status == 429 and retry):
                raise _Retry(float(retry or 5)) from None
            body = error_body(e.status, e.message, e.code, e.param)
            return False, result_line(req, e.status, rid, body)
        except Exception:  # our fault, not the line's: it fails alone, the batch goes on
            log.exception("batch %s: line %d failed", batch_id, req.line)
            msg = "the server failed on this request"
            return False, result_line(req, 500, rid, error_body(500, msg, "internal_error"))
        finally:
            BATCH_LINE.reset(token)
        return True, result_line(req, 200, answer["id"], answer)

    def _batch_budget(self, tenant_id: int) -> quotas.QuotaDecision:
        with self.state.sessions() as session:
            return quotas.check_batch_budget(session, tenant_id)

    def _record(self, batch_id: str, line: int, ok: bool, result: str) -> None:
        with self.state.sessions() as session:
            record_line(session, batch_id, line, ok, result)

    def _finalize(self, batch_id: str, expired: bool, key: str | None) -> None:
        """Write the output and error files from the finished lines, then the final state."""
        with self.state.sessions() as session:
            final = final_state(session.get(Batch, batch_id), expired)
        if not self._set(batch_id, status=BatchStatus.finalizing.value, finalizing_at=utcnow()):
            return
        with self.state.sessions() as session:
            row = session.get(Batch, batch_id)
            files, answered, failed = write_result_files(
                session, FileBlobs(self.state.store), row, final, key
            )
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
        log.info("batch %s: %s (%d answered, %d failed)", batch_id, final.value, answered, failed)


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
