"""Write an upload's streamed parts into a fresh temp folder, under a running size limit.

The web layer hands us `(filename, data)` pairs as they arrive; `data` may be a binary file
object, bytes, an iterable of byte chunks, or (in `areceive_files`) an async iterable of
chunks or an object with an async `read` such as Starlette's `UploadFile`. We stop reading
the moment the total crosses `max_bytes`, so a client cannot make us store more than that.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loraplex.platform.store.base import ADAPTER_FILES
from loraplex.platform.uploads.archive import extract_archive
from loraplex.platform.uploads.policy import (
    CHUNK,
    UploadError,
    expected_files,
    is_archive,
    is_wanted,
    refuse_pickles,
    too_large,
)

Part = tuple[str, Any]


@contextmanager
def upload_workspace(tmp_root: str | Path) -> Iterator[Path]:
    """A fresh folder under `tmp_root`, removed with all it holds when the block ends."""
    root = Path(tmp_root)
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="upload-", dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Intake:
    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.received = 0
        self.names: list[str] = []
        self.archive: tuple[Path, str] | None = None  # (where we wrote it, its upload name)

    @contextmanager
    def part(self, filename: str) -> Iterator[Callable[[bytes], None]]:
        name = filename or ""
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UploadError(
                400, "bad_file_name", f"file name {filename!r} must be a bare name, not a path"
            )
        refuse_pickles([name])
        if name in self.names:
            raise UploadError(400, "duplicate_file", f"{name} was sent twice")
        if self.archive or (self.names and is_archive(name)):
            raise UploadError(
                400, "mixed_upload", f"send either {expected_files()}, not a mix of both"
            )
        self.names.append(name)
        target: Path | None
        if is_archive(name):
            target = self.folder / f".archive-{len(self.names)}"
            self.archive = (target, name)
        else:
            target = self.folder / name if is_wanted(name) else None  # README: dropped

        out = target.open("xb") if target else None
        try:

            def write(chunk: bytes) -> None:
                self.received += len(chunk)
                if self.received > self.max_bytes:
                    raise too_large("upload", self.max_bytes)
                if out:
                    out.write(chunk)

            yield write
        finally:
            if out:
                out.close()

    def finish(self) -> Path:
        if self.archive:
            path, name = self.archive
            extract_archive(path, self.folder, self.max_bytes, name)
            path.unlink()
        missing = [n for n in ADAPTER_FILES if not (self.folder / n).is_file()]
        if missing:
            raise UploadError(
                400, "missing_file", f"{', '.join(missing)} missing; upload {expected_files()}"
            )
        return self.folder


def _chunks(data: Any) -> Iterator[bytes]:
    if isinstance(data, bytes | bytearray | memoryview):
        yield bytes(data)
    elif hasattr(data, "read"):
        while chunk := data.read(CHUNK):
            yield chunk
    else:
        yield from data


async def _achunks(data: Any) -> AsyncIterator[bytes]:
    if hasattr(data, "__aiter__"):
        async for chunk in data:
            yield chunk
    elif hasattr(data, "read") and inspect.iscoroutinefunction(data.read):
        while chunk := await data.read(CHUNK):
            yield chunk
    else:
        for chunk in _chunks(data):
            yield chunk


async def _aparts(parts: Iterable[Part] | AsyncIterable[Part]) -> AsyncIterator[Part]:
    if isinstance(parts, AsyncIterable):
        async for part in parts:
            yield part
    else:
        for part in parts:
            yield part


def _fresh(tmp_root: str | Path) -> Path:
    root = Path(tmp_root)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="parts-", dir=root))


def receive_files(parts: Iterable[Part], tmp_root: str | Path, max_bytes: int) -> Path:
    """Write `parts` into a new folder under `tmp_root`; returns it holding the two adapter files.

    On any refusal the folder is removed before UploadError propagates. On success the
    caller owns it: call inside `upload_workspace` so it goes away after storing.
    """
    folder = _fresh(tmp_root)
    try:
        intake = _Intake(folder, max_bytes)
        for filename, data in parts:
            with intake.part(filename) as write:
                for chunk in _chunks(data):
                    write(chunk)
        return intake.finish()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


async def areceive_files(
    parts: Iterable[Part] | AsyncIterable[Part], tmp_root: str | Path, max_bytes: int
) -> Path:
    """`receive_files` for async sources; disk writes stay inline (1 MiB chunks to local disk).

    Archive extraction runs inline too; call it via a thread if a large archive must not
    hold the event loop.
    """
    folder = _fresh(tmp_root)
    try:
        intake = _Intake(folder, max_bytes)
        async for filename, data in _aparts(parts):
            with intake.part(filename) as write:
                async for chunk in _achunks(data):
                    write(chunk)
        return intake.finish()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
