"""A local disk cache in front of an `AdapterStore`, so the engine reads adapters from disk.

    cache_dir/
      .partial/…           downloads in flight (removed at start and after each attempt)
      <digest>/            adapter_config.json, adapter_model.safetensors (verified)

Folders are named by digest and published with one rename after the digest is checked, so a
folder in the cache is always complete and correct. Eviction is LRU by total bytes and skips
folders in use (`use()` pins one); a single adapter larger than `max_bytes` is still served,
it just leaves nothing else cached.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.store.base import AdapterStore, StoreError, adapter_digest, check_digest


@dataclass
class CacheStats:
    hits: int = 0
    loads: int = 0  # downloads from the store
    evictions: int = 0


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


class AdapterCache:
    def __init__(self, store: AdapterStore, cache_dir: str | Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.store, self.max_bytes = store, max_bytes
        self.dir = Path(cache_dir).absolute()
        self._partial = self.dir / ".partial"
        shutil.rmtree(self._partial, ignore_errors=True)  # a previous process's leftovers
        self._partial.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._lock = threading.Lock()  # guards the three dicts below
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest first
        self._pins: dict[str, int] = {}
        # One lock per digest ever fetched, never dropped: a waiter must find the same lock.
        self._fetching: dict[str, threading.Lock] = {}
        # Keep what an earlier run downloaded, oldest first by mtime (bumped on each use).
        found = [p for p in self.dir.iterdir() if p.is_dir() and p != self._partial]
        for p in sorted(found, key=lambda p: p.stat().st_mtime):
            try:
                self._entries[check_digest(p.name)] = _folder_bytes(p)
            except ValueError:
                continue  # not ours: leave it alone

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def cached(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def get(self, key: str, digest: str) -> Path:
        """The local folder of the adapter, downloading it once.

        The folder is not pinned: a later `get` of another adapter may evict it. Callers that
        read it while other threads use the cache should hold `use()` instead.
        """
        with self.use(key, digest) as folder:
            return folder

    @contextmanager
    def use(self, key: str, digest: str) -> Iterator[Path]:
        """The local folder of the adapter, kept from eviction until the block ends."""
        check_digest(digest)
        with self._lock:
            self._pins[digest] = self._pins.get(digest, 0) + 1
        try:
            yield self._ensure(key, digest)
        finally:
            with self._lock:
                self._pins[digest] -= 1
                if not self._pins[digest]:
                    del self._pins[digest]

    def _hit(self, digest: str) -> Path | None:
        # Caller holds self._lock.
        if digest not in self._entries:
            return None
        self._entries.move_to_end(digest)
        self.stats.hits += 1
        folder = self.dir / digest
        with suppress(FileNotFoundError):
            os.utime(folder)  # so LRU order survives a restart
        return folder

    def _ensure(self, key: str, digest: str) -> Path:
        with self._lock:
            if (folder := self._hit(digest)) is not None:
                return folder
            fetching = self._fetching.setdefault(digest, threading.Lock())
        # One download per digest: later callers wait here, then find it cached.
        with fetching:
            with self._lock:
                if (folder := self._hit(digest)) is not None:
                    return folder
            folder = self._download(key, digest)
            with self._lock:
                self._entries[digest] = _folder_bytes(folder)
                self.stats.loads += 1
                doomed = self._pick_victims()
        for victim in doomed:
            shutil.rmtree(victim, ignore_errors=True)
        return folder

    def _download(self, key: str, digest: str) -> Path:
        final = self.dir / digest
        tmp = Path(tempfile.mkdtemp(prefix=f"{digest[:12]}-", dir=self._partial))
        try:
            got = self.store.fetch(key, tmp / "adapter")
            actual = adapter_digest(got)
            if actual != digest:
                raise StoreError(
                    f"adapter {key}: the stored files hash to {actual}, not the registered "
                    f"{digest}; the stored object is corrupt or was replaced; upload it again"
                )
            if final.exists():  # left by an earlier run that our scan missed (e.g. a race)
                shutil.rmtree(final)
            os.replace(got, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _pick_victims(self) -> list[Path]:
        """Unlist least-recently-used unpinned entries until the total fits; caller holds lock.

        The folders are moved aside here (cheap) and removed by the caller outside the lock.
        """
        total = sum(self._entries.values())
        doomed = []
        for digest in list(self._entries):
            if total <= self.max_bytes:
                break
            if self._pins.get(digest):
                continue
            total -= self._entries.pop(digest)
            self.stats.evictions += 1
            aside = Path(tempfile.mkdtemp(prefix="evict-", dir=self._partial))
            with suppress(FileNotFoundError):
                os.replace(self.dir / digest, aside / digest)
            doomed.append(aside)
        return doomed
