"""Unpack an uploaded `.tar.gz` / `.zip` of a PEFT folder without trusting anything in it.

Entries are never extracted by their own path: each regular file is checked, then written
under its bare name into the target folder, so traversal cannot reach outside it even if a
check were missed. Links, devices and nested folders are refused, not skipped. Uncompressed
bytes are counted as they come out of the decompressor (tar) or as they are written (zip)
against `max_bytes`; header-declared sizes only let a bomb fail before any work.
"""

from __future__ import annotations

import gzip
import re
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from loraplex.platform.uploads.policy import (
    CHUNK,
    MAX_ARCHIVE_ENTRIES,
    UploadError,
    is_wanted,
    refuse_pickles,
    too_large,
    unknown_files,
)

# tar framing around at most MAX_ARCHIVE_ENTRIES members: 512-byte headers, padding, end
# blocks, and the 10 KiB record a tar writer rounds up to.
_TAR_SLACK = 64 * 1024
_BROKEN = (tarfile.TarError, zipfile.BadZipFile, zlib.error, gzip.BadGzipFile, EOFError)


def _bomb(limit: int) -> UploadError:
    return too_large("archive contents (uncompressed; a decompression bomb?)", limit)


def _too_many() -> UploadError:
    return UploadError(
        400,
        "too_many_entries",
        f"archive has more than {MAX_ARCHIVE_ENTRIES} entries; it should hold only the "
        "adapter files",
    )


def _unsafe(name: str, why: str) -> UploadError:
    return UploadError(400, "unsafe_archive", f"archive entry {name!r} {why}; refused")


class _Extractor:
    """Checks entries one at a time and tracks layout, names and the byte budget."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.entries = 0
        self.used = 0
        self.top: str | None = None  # "" = files at the root, else the single top folder
        self.seen: set[str] = set()
        self.unknown: list[str] = []

    def spend(self, n: int) -> None:
        self.used += n
        if self.used > self.max_bytes:
            raise _bomb(self.max_bytes)

    def check(self, raw: str, kind: str, size: int) -> str | None:
        """The bare file name to write this entry as, or None to skip it (folders, README)."""
        self.entries += 1
        if self.entries > MAX_ARCHIVE_ENTRIES:
            raise _too_many()
        name = raw.replace("\\", "/")
        if name.startswith("/") or re.match(r"[A-Za-z]:", name):
            raise _unsafe(raw, "is an absolute path")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise _unsafe(raw, "climbs out of the archive with '..'")
        if kind == "symlink":
            raise _unsafe(raw, "is a symbolic link")
        if kind == "hardlink":
            raise _unsafe(raw, "is a hard link")
        if kind == "special":
            raise _unsafe(raw, "is a device, pipe or other special file")
        if not parts and kind != "dir":
            raise _unsafe(raw, "is a file without a name")
        if len(parts) > (1 if kind == "dir" else 2):
            raise UploadError(
                400,
                "bad_layout",
                f"archive entry {raw!r} is nested too deep; put the adapter files at the "
                "archive's root or inside one top folder",
            )
        if kind == "dir":
            return None  # the top folder itself (or the root)
        refuse_pickles([parts[-1]])
        top = parts[0] if len(parts) == 2 else ""
        if self.top is None:
            self.top = top
        elif self.top != top:
            raise UploadError(
                400,
                "bad_layout",
                f"archive holds files in more than one place ({self.top or 'root'!r} and "
                f"{top or 'root'!r}); put them at the root or inside one top folder",
            )
        base = parts[-1]
        if base in self.seen:
            raise UploadError(400, "duplicate_file", f"archive holds {base} twice")
        self.seen.add(base)
        try:
            keep = is_wanted(base)
        except UploadError:
            self.unknown.append(name)
            return None
        if self.used + size > self.max_bytes:  # declared size: fail before decompressing
            raise _bomb(self.max_bytes)
        if not keep:
            self.spend(size)
            return None
        return base

    def write(self, src: BinaryIO, base: str) -> None:
        with (self.folder / base).open("xb") as out:
            while chunk := src.read(CHUNK):
                self.spend(len(chunk))
                out.write(chunk)

    def finish(self) -> None:
        if self.unknown:
            raise unknown_files(self.unknown)


class _Capped:
    """A read-only stream that refuses to yield more than `limit` bytes in total.

    tarfile reads pax/GNU long-name payloads into memory before we see the member, so the
    decompressed stream itself must be capped, not just the members we extract.
    """

    def __init__(self, inner: BinaryIO, limit: int, on_over):
        self.inner, self.left, self.on_over = inner, limit, on_over

    def read(self, n: int = -1) -> bytes:
        want = self.left + 1 if n < 0 else min(n, self.left + 1)
        data = self.inner.read(want)
        self.left -= len(data)
        if self.left < 0:
            raise self.on_over()
        return data


def _tar_kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "symlink"
    if m.islnk():
        return "hardlink"
    if m.isdir():
        return "dir"
    return "file" if m.isreg() else "special"


def _zip_kind(info: zipfile.ZipInfo) -> str:
    mode = info.external_attr >> 16  # unix st_mode when the creator was unix, else 0
    if info.is_dir():
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "file" if stat.S_IFMT(mode) in (0, stat.S_IFREG) else "special"


def extract_archive(archive: Path, folder: Path, max_bytes: int, name: str | None = None) -> None:
    """Write the adapter files found in `archive` into `folder`; raise UploadError if unsafe.

    `name` is the uploaded file's name, used to pick the format and in messages.
    """
    name = name or archive.name
    ex = _Extractor(folder, max_bytes)
    try:
        if name.lower().endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                infos = zf.infolist()
                if len(infos) > MAX_ARCHIVE_ENTRIES:
                    raise _too_many()
                for info in infos:
                    if info.flag_bits & 0x1:
                        raise UploadError(
                            400,
                            "bad_archive",
                            f"{info.filename}: encrypted zip entries are refused",
                        )
                    base = ex.check(info.filename, _zip_kind(info), info.file_size)
                    if base is not None:
                        with zf.open(info) as src:
                            ex.write(src, base)
        else:
            with gzip.open(archive, "rb") as gz:
                capped = _Capped(gz, max_bytes + _TAR_SLACK, lambda: _bomb(max_bytes))
                with tarfile.open(fileobj=capped, mode="r|") as tar:
                    for member in tar:
                        base = ex.check(member.name, _tar_kind(member), member.size)
                        if base is not None:
                            src = tar.extractfile(member)
                            assert src is not None  # regular files always have data
                            ex.write(src, base)
    except _BROKEN as e:
        raise UploadError(400, "bad_archive", f"{name}: not a readable archive ({e})") from None
    except NotImplementedError as e:  # zipfile: an unsupported compression method
        raise UploadError(400, "bad_archive", f"{name}: {e}") from None
    ex.finish()
