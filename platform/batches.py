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

Here: the jobs in the registry (create, look up, cancel, their public shape, their result
lines and files). The runner is platform/batch_runner.py.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.models import Batch, BatchLine, BatchStatus, StoredFile, utcnow
from loraplex.platform.errors import APIError
from loraplex.platform.files import (
    BATCH_ENDPOINTS,
    BatchRequestLine,
    FileBlobs,
    create_file,
    get_file,
    parse_batch_input,
)
from loraplex.platform.state import Caller

WINDOW = timedelta(hours=24)
ACTIVE = (
    BatchStatus.validating.value,
    BatchStatus.in_progress.value,
    BatchStatus.finalizing.value,
    BatchStatus.cancelling.value,
)


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


# ---------------------------------------------------------------- results


def result_line(req: BatchRequestLine, status: int, request_id: str, body: dict) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": req.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def error_line(req: BatchRequestLine, code: str, message: str) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": req.custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0] if e.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, str | int)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def record_line(session: Session, batch_id: str, line: int, ok: bool, result: str) -> None:
    """Write a finished line's output (or error) line; a line answered twice (two runners
    racing past a lease) keeps its first answer."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    session.execute(
        dialect.insert(BatchLine)
        .values(batch_id=batch_id, line=line, ok=ok, result=result, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=[BatchLine.batch_id, BatchLine.line])
    )
    session.commit()


def final_state(row: Batch, expired: bool) -> BatchStatus:
    if row.cancelling_at is not None:
        return BatchStatus.cancelled
    if expired or utcnow() >= row.expires_at:
        return BatchStatus.expired
    return BatchStatus.completed


def write_result_files(
    session: Session, blobs: FileBlobs, row: Batch, final: BatchStatus, key: str | None
) -> tuple[dict[str, str], int, int]:
    """The output and error files of the batch's finished lines (and, when it expired, an
    error line for each line it never ran): ({"output"|"error": file id}, answered, failed).
    Again after a crash: the files' ids are the batch's own, so a second try reuses them."""
    results = session.execute(
        select(BatchLine.line, BatchLine.ok, BatchLine.result)
        .where(BatchLine.batch_id == row.id)
        .order_by(BatchLine.line)
    ).all()
    out = [r.result for r in results if r.ok]
    err = [r.result for r in results if not r.ok]
    if final == BatchStatus.expired and key is not None:
        answered = {r.line for r in results}
        expired = "This request could not be executed before the completion window expired."
        lines = parse_batch_input(blobs.get(key), max_lines=1 << 30)
        err += [error_line(req, "batch_expired", expired) for req in lines
                if req.line not in answered]  # fmt: skip
    files = {}
    for kind, content in (("output", out), ("error", err)):
        if not content:
            continue
        file_id = f"file-{row.id.removeprefix('batch_')}-{kind[:3]}"
        if session.get(StoredFile, file_id) is None:
            create_file(
                session,
                blobs,
                tenant_id=row.tenant_id,
                purpose="batch_output",
                filename=f"{row.id}_{kind}.jsonl",
                data=("\n".join(content) + "\n").encode(),
                file_id=file_id,
            )
        files[kind] = file_id
    return files, len(out), len(err)
