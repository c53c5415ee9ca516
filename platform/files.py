"""The Files API's files: their bytes in the adapter store, their rows in the registry.

A file's bytes are one object of the adapter store (local folder or S3), under a key of the
store's own scheme (`<sha256>-<16 random hex>`, platform/store/base.py) but in a `files/`
area beside the adapters:

    local:  <store root>/files/<key[:2]>/<key>
    S3:     <prefix>/files/<key>

The adapters' collector of unreferenced objects lists only adapter keys at the root, so it
never sees these. A file belongs to one tenant: every lookup here is by (tenant, id), and
another tenant's id gets the same 404 as an id that never existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import StoredFile
from loraplex.platform.errors import APIError
from loraplex.platform.openai.bodies import check_json_depth
from loraplex.platform.store import LocalStore, StoreError
from loraplex.platform.store.base import AdapterStore, check_key, new_key

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
PURPOSES = ("batch", "batch_output")  # what a tenant may upload: "batch"
AREA = "files"


class FileBlobs:
    """Put, read and delete whole files in the adapter store's `files/` area."""

    def __init__(self, store: AdapterStore):
        self.store = store

    def _local_path(self, key: str) -> Path:
        assert isinstance(self.store, LocalStore)
        check_key(key)
        return self.store.root / AREA / key[:2] / key

    def _s3_key(self, key: str) -> str:
        check_key(key)
        prefix = self.store.prefix  # type: ignore[attr-defined]
        return f"{prefix}/{AREA}/{key}" if prefix else f"{AREA}/{key}"

    def put(self, data: bytes) -> str:
        key = new_key(hashlib.sha256(data).hexdigest())
        if isinstance(self.store, LocalStore):
            final = self._local_path(key)
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                # Written beside and renamed: a reader sees the whole file or none.
                fd, tmp = tempfile.mkstemp(prefix=".put-", dir=final.parent)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, final)
            except OSError as e:
                raise StoreError(f"cannot write file {key} into {self.store.root}: {e}") from None
            return key
        try:
            self.store.client.put_object(  # type: ignore[attr-defined]
                Bucket=self.store.bucket,  # type: ignore[attr-defined]
                Key=self._s3_key(key),
                Body=data,
            )
        except Exception as e:  # boto's errors, said as the store says them
            raise self.store._error(e, f"uploading file {key}") from None  # type: ignore[attr-defined]
        return key

    def get(self, key: str) -> bytes:
        if isinstance(self.store, LocalStore):
            try:
                return self._local_path(key).read_bytes()
            except OSError as e:
                raise StoreError(f"cannot read file {key} from {self.store.root}: {e}") from None
        try:
            obj = self.store.client.get_object(  # type: ignore[attr-defined]
                Bucket=self.store.bucket,  # type: ignore[attr-defined]
                Key=self._s3_key(key),
            )
            return obj["Body"].read()
        except Exception as e:
            raise self.store._error(e, f"downloading file {key}") from None  # type: ignore[attr-defined]

    def delete(self, key: str) -> None:
        """Deleting a missing file is not an error."""
        if isinstance(self.store, LocalStore):
            try:
                self._local_path(key).unlink(missing_ok=True)
            except OSError as e:
                raise StoreError(f"cannot remove file {key}: {e}") from None
            return
        try:
            self.store.client.delete_object(  # type: ignore[attr-defined]
                Bucket=self.store.bucket,  # type: ignore[attr-defined]
                Key=self._s3_key(key),
            )
        except Exception as e:
            raise self.store._error(e, f"deleting file {key}") from None  # type: ignore[attr-defined]


# ---------------------------------------------------------------- batch input validation


@dataclass(frozen=True)
class BatchRequestLine:
    line: int  # 0-based index in the file
    custom_id: str
    url: str
    body: dict


def _bad_line(number: int, message: str) -> APIError:
    return APIError(400, f"line {number}: {message}", "invalid_file", "file")


def parse_batch_input(data: bytes, *, max_lines: int) -> list[BatchRequestLine]:
    """The requests of a batch input file (JSONL of {custom_id, method, url, body}); the
    first bad line is refused with its 1-based number. Blank lines are skipped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise _bad_line(line, "not UTF-8 text") from None
    out: list[BatchRequestLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        # json.loads recurses per nesting level: a deep enough line would raise RecursionError
        deep = check_json_depth(raw)
        if deep:
            raise _bad_line(number, deep)
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _bad_line(number, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(item, dict):
            raise _bad_line(number, "each line must be a JSON object")
        extra = set(item) - {"custom_id", "method", "url", "body"}
        if extra:
            raise _bad_line(number, f"unknown field(s) {sorted(extra)}")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            raise _bad_line(number, "'custom_id' must be a string of 1 to 512 characters")
        if custom_id in seen:
            raise _bad_line(
                number, f"custom_id {custom_id[:80]!r} is also on line {seen[custom_id]}"
            )
        seen[custom_id] = number
        if item.get("method") != "POST":
            raise _bad_line(number, "'method' must be \"POST\"")
        url = item.get("url")
        if url not in BATCH_ENDPOINTS:
            raise _bad_line(number, f"'url' must be one of {list(BATCH_ENDPOINTS)}")
        body = item.get("body")
        if not isinstance(body, dict):
            raise _bad_line(number, "'body' must be a JSON object (the request's body)")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _bad_line(number, "'body.model' must name the base model or an adapter")
        if body.get("stream"):
            raise _bad_line(number, "'body.stream' is not supported in a batch")
        out.append(BatchRequestLine(len(out), custom_id, url, body))
        if len(out) > max_lines:
            raise _bad_line(number, f"a batch file holds at most {max_lines} requests")
    if not out:
        raise APIError(400, "the file holds no requests", "invalid_file", "file")
    return out


# ---------------------------------------------------------------- registry


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_public(row: StoredFile) -> dict:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at.timestamp()),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def get_file(session: Session, *, tenant_id: int, file_id: str) -> StoredFile:
    row = session.get(StoredFile, file_id) if len(file_id) <= 40 else None
    if row is None or row.tenant_id != tenant_id:
        # The same answer whether or not another tenant has such a file.
        raise APIError(404, f"No such File object: {file_id[:80]}", "file_not_found", "file_id")
    return row


def tenant_file_bytes(session: Session, *, tenant_id: int) -> int:
    total = session.scalar(
        select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
            StoredFile.tenant_id == tenant_id
        )
    )
    return int(total or 0)


def create_file(
    session: Session,
    blobs: FileBlobs,
    *,
    tenant_id: int,
    purpose: str,
    filename: str,
    data: bytes,
    lines: int = 0,
    file_id: str | None = None,
) -> StoredFile:
    """Store the bytes, then the row (a crash between leaves an object no row names)."""
    key = blobs.put(data)
    row = StoredFile(
        id=file_id or new_file_id(),
        tenant_id=tenant_id,
        purpose=purpose,
        filename=filename[:256],
        bytes=len(data),
        lines=lines,
        storage_key=key,
    )
    session.add(row)
    try:
        session.commit()
    except Exception:
        session.rollback()
        blobs.delete(key)
        raise
    return row
