"""HTTP helpers for adapter uploads: multipart parts, archives, and the upload call itself."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import httpx

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

Files = list[tuple[str, tuple[str, bytes]]]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def folder_parts(folder: Path, names: tuple[str, ...] | None = None) -> Files:
    """Multipart file parts for the files in `folder` (default: the two PEFT files present)."""
    keep = [p for p in sorted(folder.iterdir()) if p.is_file()]
    if names is not None:
        keep = [p for p in keep if p.name in names]
    else:
        keep = [p for p in keep if p.name in ADAPTER_FILES]
    return [("files", (p.name, p.read_bytes())) for p in keep]


def tar_gz(entries: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    """A .tar.gz holding `entries` (archive path -> bytes) and symlinks (path -> target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def zip_bytes(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buf.getvalue()


def folder_entries(folder: Path, top: str = "") -> dict[str, bytes]:
    """The PEFT files of `folder` as archive entries, optionally inside folder `top`."""
    prefix = f"{top}/" if top else ""
    return {f"{prefix}{n}": (folder / n).read_bytes() for n in ADAPTER_FILES}


def upload(url: str, key: str, name: str | None, files: Files) -> httpx.Response:
    """POST /v1/adapters as a client would: a `name` form field plus file parts."""
    data = {"name": name} if name is not None else {}
    return httpx.post(
        f"{url}/v1/adapters", headers=auth(key), data=data, files=files or None, timeout=60
    )


def complete(url: str, key: str, model: str, prompt: str = "The quick brown", **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/completions", headers=auth(key), json=body, timeout=60)
