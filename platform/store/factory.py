"""`make_store`: the store a URL names. Apart from base.py, which the stores themselves build on,
so that the interface never imports its implementations."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from loraplex.platform.store.base import AdapterStore, MiB, StoreError
from loraplex.platform.store.local import LocalStore


def make_store(
    store_url: str | Path,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    multipart_threshold: int = 8 * MiB,
) -> AdapterStore:
    """A store for `s3://bucket/prefix`, `file:///abs/path` or a plain folder path."""
    text = str(store_url)
    parsed = urlparse(text)
    if parsed.scheme == "s3":
        from loraplex.platform.store.s3 import S3Store  # boto3 only for an S3 store

        if not parsed.netloc:
            raise StoreError(f"store URL {text!r} names no bucket; expected s3://bucket/prefix")
        return S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
            multipart_threshold=multipart_threshold,
        )

    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(
                f"store URL {text!r}: file URLs need an absolute path, e.g. file:///srv/adapters"
            )
        return LocalStore(Path(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive, a plain path
        raise StoreError(
            f"store URL {text!r}: unsupported scheme {parsed.scheme!r}; "
            "use a folder path, file:///path or s3://bucket/prefix"
        )
    return LocalStore(Path(text).expanduser())
