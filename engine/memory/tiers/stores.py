"""The stores a KV block can live in below the device pool, each behind one small interface:
`get_many(keys)` (records or None, in order; a store may stop at the first miss, since a
prefix is useless past a gap) and `put(key, record)`. Records are opaque bytes here;
engine/memory/tiers/keys.py makes and checks them.

    host    a bounded LRU of records in this process's memory
    disk    one file per record under a folder (bounded, least recently used deleted first);
            written to a temporary and renamed, so a reader (or a restart after a writer was
            killed mid-write) never sees half a record; survives restarts
    redis   a shared Redis (redis://host:port/db): SET with a TTL, MGET per lookup
    s3      a shared S3 bucket (s3://bucket/prefix; AWS_ENDPOINT_URL for moto / MinIO): one
            object per record, lifetimes by the bucket's lifecycle rules

The lookup and writer threads (engine/memory/tiers/manager.py) call these concurrently, so
the local stores lock their indexes; the clients of the shared stores are thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlparse

from loraplex.engine.memory.tiers.keys import tmp_name


class HostStore:
    name = "host"

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lru: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for k in keys:
                rec = self._lru.get(k)
                if rec is None:
                    break
                self._lru.move_to_end(k)
                out.append(rec)
        return out + [None] * (len(keys) - len(out))

    def put(self, key: bytes, record: bytes) -> None:
        if len(record) > self.max_bytes:
            return
        with self._lock:
            old = self._lru.pop(key, None)
            self.nbytes -= len(old) if old is not None else 0
            self._lru[key] = record
            self.nbytes += len(record)
            while self.nbytes > self.max_bytes:
                _, rec = self._lru.popitem(last=False)
                self.nbytes -= len(rec)

    def close(self) -> None:
        pass


class DiskStore:
    name = "disk"

    def __init__(self, path: str | Path, max_bytes: int):
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # key hex -> size, least recently used first; rebuilt from the folder (oldest mtime
        # first) so entries survive a restart. Temporaries a killed writer left are removed.
        files = []
        for f in self.root.glob("*/*"):
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
            else:
                st = f.stat()
                files.append((st.st_mtime, f.name, st.st_size))
        self._index: OrderedDict[str, int] = OrderedDict((n, s) for _, n, s in sorted(files))
        self.nbytes = sum(self._index.values())

    def _path(self, hexkey: str) -> Path:
        return self.root / hexkey[:2] / hexkey

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            h = k.hex()
            with self._lock:
                known = h in self._index
                if known:
                    self._index.move_to_end(h)
            try:
                rec = self._path(h).read_bytes() if known else None
            except FileNotFoundError:  # another process's eviction: a miss
                rec = None
            if rec is None:
                break
            out.append(rec)
        return out + [None] * (len(keys) - len(out))

    def put(self, key: bytes, record: bytes) -> None:
        h = key.hex()
        path = self._path(h)
        path.parent.mkdir(exist_ok=True)
        tmp = tmp_name(path)
        tmp.write_bytes(record)
        os.replace(tmp, path)  # atomic: concurrent writers of one key leave one whole record
        evict = []
        with self._lock:
            self.nbytes += len(record) - self._index.pop(h, 0)
            self._index[h] = len(record)
            while self.nbytes > self.max_bytes and len(self._index) > 1:
                old, size = self._index.popitem(last=False)
                self.nbytes -= size
                evict.append(old)
        for old in evict:
            self._path(old).unlink(missing_ok=True)

    def close(self) -> None:
        pass


class RedisStore:
    name = "shared"

    def __init__(self, url: str, ttl_s: int, prefix: str = "lpkv:"):
        import redis  # imported here: only engines with a Redis tier need the client

        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.ttl_s = ttl_s
        self.prefix = prefix.encode()
        self.kind = "redis"

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return list(self.client.mget([self.prefix + k.hex().encode() for k in keys]))

    def put(self, key: bytes, record: bytes) -> None:
        self.client.set(self.prefix + key.hex().encode(), record, ex=self.ttl_s or None)

    def close(self) -> None:
        self.client.close()


class S3Store:
    name = "shared"

    def __init__(self, url: str, prefix: str = "lpkv/"):
        import boto3  # a dependency already (the adapter store); imported only when used

        u = urlparse(url)
        self.bucket = u.netloc
        self.prefix = (u.path.lstrip("/") + "/" if u.path.strip("/") else "") + prefix
        self.client = boto3.client("s3")
        self.kind = "s3"

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:  # S3 has no multi-get: one GET per block, stopping at the first miss
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=self.prefix + k.hex())
                out.append(obj["Body"].read())
            except self.client.exceptions.NoSuchKey:
                break
        return out + [None] * (len(keys) - len(out))

    def put(self, key: bytes, record: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key.hex(), Body=record)

    def close(self) -> None:
        pass


def shared_store(url: str, ttl_s: int):
    """The shared tier a URL names: redis://, rediss:// or s3://."""
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, ttl_s)
    if scheme == "s3":
        return S3Store(url)
    raise ValueError(f"kv_tier_shared_url must be redis://, rediss:// or s3://, got {url!r}")
