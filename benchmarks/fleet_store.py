"""`python -m benchmarks.fleet --store`: replicas that fetch adapters from a store, as served
ones do.

With `--store local` (the default) every replica's engine reads the bench's adapter folders
directly: a cold load is a read from the page cache. A served replica instead finds the
adapter in its own disk cache (`platform/store/cache.py`) or fetches it from the store
(S3) first, on the request's path. `--store s3://bucket/prefix` (with `--s3-endpoint`), or
`--store moto` (a local moto S3 server over HTTP; `pip install 'moto[server]'`, in the test
extra), puts every adapter in that store once; each replica then gets a fresh disk cache of
`--disk-cache-mb` (the `serve` default is 8 GiB: everything) and every request goes through
`AdapterCache.use` on its replica before it reaches the engine, so the time to fetch counts in
its TTFT.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from testkit.moto_server import ACCESS_KEY, REGION, SECRET_KEY, moto_server

BUCKET = "loraplex-bench"


class FleetStore:
    """The adapters in a store, and one disk cache per replica in front of it."""

    def __init__(self, store, keys: list[str], disk_cache_bytes: int):
        self.store, self.keys, self.disk_cache_bytes = store, keys, disk_cache_bytes
        self._root = Path(tempfile.mkdtemp(prefix="loraplex-fleet-caches-"))
        self.caches: list = []
        self.cold_s: list[float] = []  # time of each request that found its adapter not cached

    def fresh_caches(self, replicas: int) -> None:
        """Empty disk caches, one per replica (each run starts cold, like new pods)."""
        from loraplex.platform.store import AdapterCache

        for c in self.caches:
            c.close()
        shutil.rmtree(self._root, ignore_errors=True)
        self.caches = [
            AdapterCache(self.store, self._root / f"replica-{i}", self.disk_cache_bytes)
            for i in range(replicas)
        ]

    def folder(self, replica: int, adapter: int) -> str:
        """The adapter's folder on the replica's disk, fetched from the store if not there."""
        from loraplex.platform.store.base import key_digest

        key, cache = self.keys[adapter], self.caches[replica]
        digest = key_digest(key)  # the disk cache is keyed by content
        if cache.cached(digest):
            return str(cache.get(key, digest))
        start = time.monotonic()
        folder = cache.get(key, digest)  # fetches, or waits for another request's fetch
        self.cold_s.append(time.monotonic() - start)
        return str(folder)

    def fetches(self) -> int:
        return sum(c.stats.loads for c in self.caches)

    def close(self) -> None:
        for c in self.caches:
            c.close()
        shutil.rmtree(self._root, ignore_errors=True)


@contextmanager
def open_store(args, adapters: list[Path]) -> Iterator[FleetStore | None]:
    """None for `--store local`; else the adapters uploaded once to the store."""
    if args.store == "local":
        yield None
        return
    from loraplex.platform.store import adapter_digest, make_store

    with moto_server() if args.store == "moto" else nullcontext() as moto_url:
        if moto_url is not None:
            creds = dict(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION)
            store = make_store(f"s3://{BUCKET}/fleet", endpoint_url=moto_url, **creds)
            store.client.create_bucket(Bucket=BUCKET)
        else:
            store = make_store(args.store, endpoint_url=args.s3_endpoint,
                               region=os.environ.get("AWS_REGION"))  # fmt: skip
        store.check()
        t = time.monotonic()
        keys = [store.put(p, adapter_digest(p)) for p in adapters]
        print(f"fleet: {len(keys)} adapters put in {args.store} in {time.monotonic() - t:.1f}s",
              flush=True)  # fmt: skip
        fleet = FleetStore(store, keys, args.disk_cache_mb << 20)
        try:
            yield fleet
        finally:
            fleet.close()
