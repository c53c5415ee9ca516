"""A local disk cache in front of an `AdapterStore`, so the engine reads adapters from disk.

    cache_dir/
      .partial/<owner>.lock  held (flock) by a live process for as long as it runs
      .partial/<owner>/…     that process's downloads in flight and folders being evicted
      <digest>/              adapter_config.json, adapter_model.safetensors (verified)

Folders are named by digest and published with one rename after the digest is checked, so a
folder in the cache is always complete and correct. Eviction is LRU by total bytes and skips
folders in use (`use()` pins one); a single adapter larger than `max_bytes` is still served,
it just leaves nothing else cached.

Several processes may share one cache folder (Ray Serve replicas on one node, or several
`loraplex serve` on one data folder), and any of them may be killed at any point:
- a published folder is never changed in place: it is replaced or evicted by renaming it
  into the process's own `.partial/<owner>/` first, so a reader sees a whole folder or none;
- each process removes only its own in-flight files, and at start those of owners whose
  lock is free (the process is gone), never a live neighbour's;
- a folder another process published is adopted after its digest is checked, not downloaded
  again; a folder found at start or in a lost publish race is checked once before first use;
- a listed folder that another process evicted is noticed on the next use and fetched again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.store.base import (
    AdapterStore,
    StoreError,
    adapter_digest,
    check_digest,
)


@dataclass
class CacheStats:
    hits: int = 0
    loads: int = 0  # downloads from the store
    evictions: int = 0
    adopted: int = 0  # folders another process (or an earlier run) published, checked and used


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _whole(folder: Path, digest: str) -> bool:
    """The folder holds exactly the adapter with this digest."""
    try:
        return adapter_digest(folder) == digest
    except (OSError, StoreError):
        return False


def _remove_dead_owners(partial: Path) -> None:
    """Remove the in-flight files of processes that are gone (their lock is free)."""
    for lock in partial.glob("*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue  # another starter cleaned it up
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # alive
        try:
            shutil.rmtree(partial / lock.stem, ignore_errors=True)
            with suppress(FileNotFoundError):
                lock.unlink()
        finally:
            os.close(fd)
    # Folders with no lock beside them: an owner's lock is taken before its folder exists.
    for entry in partial.iterdir():
        if entry.is_dir() and not (partial / f"{entry.name}.lock").exists():
            shutil.rmtree(entry, ignore_errors=True)


class AdapterCache:
    def __init__(self, store: AdapterStore, cache_dir: str | Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.store, self.max_bytes = store, max_bytes
        self.dir = Path(cache_dir).absolute()
        partial = self.dir / ".partial"
        partial.mkdir(parents=True, exist_ok=True)
        # Our lock first, then our folder: a neighbour's cleanup never takes a live one's.
        self._owner_fd, self._owner_lock = self._take_owner_lock(partial)
        _remove_dead_owners(partial)
        self._partial = partial / self._owner_lock.stem
        self._partial.mkdir()
        self.stats = CacheStats()
        self._lock = threading.Lock()  # guards the dicts and the set below
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest first
        self._unchecked: set[str] = set()  # listed, not yet checked by this process
        self._pins: dict[str, int] = {}
        # One lock per digest ever fetched, never dropped: a waiter must find the same lock.
        self._fetching: dict[str, threading.Lock] = {}
        # Keep what an earlier run downloaded, oldest first by mtime (bumped on each use).
        found = [p for p in self.dir.iterdir() if p.is_dir() and p != partial]
        for p in sorted(found, key=lambda p: p.stat().st_mtime):
            try:
                digest = check_digest(p.name)
                self._entries[digest] = _folder_bytes(p)
            except (ValueError, OSError):
                continue  # not ours, or gone meanwhile: leave it alone
            self._unchecked.add(digest)

    @staticmethod
    def _take_owner_lock(partial: Path) -> tuple[int, Path]:
        lock = Path(tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=".lock", dir=partial)[1])
        fd = os.open(lock, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # new and unlocked: never waits
        return fd, lock

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
        if digest not in self._entries or digest in self._unchecked:
            return None
        folder = self.dir / digest
        try:
            os.utime(folder)  # so LRU order survives a restart
        except FileNotFoundError:  # another process sharing the folder evicted it
            del self._entries[digest]
            return None
        self._entries.move_to_end(digest)
        self.stats.hits += 1
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
            folder = self.dir / digest
            adopted = _whole(folder, digest)
            if not adopted:
                self._download(key, digest)
            with self._lock:
                self._unchecked.discard(digest)
                self._entries[digest] = _folder_bytes(folder)
                self._entries.move_to_end(digest)
                if adopted:
                    self.stats.adopted += 1
                else:
                    self.stats.loads += 1
                doomed = self._pick_victims()
        for victim in doomed:
            shutil.rmtree(victim, ignore_errors=True)
        return folder

    def _set_aside(self, folder: Path) -> Path | None:
        """Rename a published folder into our own in-flight folder; None if it is gone."""
        aside = Path(tempfile.mkdtemp(prefix="aside-", dir=self._partial))
        try:
            os.replace(folder, aside / folder.name)
        except FileNotFoundError:
            shutil.rmtree(aside, ignore_errors=True)
            return None
        return aside

    def _download(self, key: str, digest: str) -> None:
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
            for _ in range(3):
                if final.exists():
                    if _whole(final, digest):
                        return  # a neighbour published it meanwhile: theirs serves
                    # Damaged (e.g. an older version's leftover): out of the way, whole.
                    if (aside := self._set_aside(final)) is not None:
                        shutil.rmtree(aside, ignore_errors=True)
                try:
                    os.replace(got, final)
                    return
                except OSError as e:  # lost a race to publish: look again
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
            raise StoreError(f"adapter {key}: could not publish {final}; check the cache folder")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

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
            self._unchecked.discard(digest)
            self.stats.evictions += 1
            if (aside := self._set_aside(self.dir / digest)) is not None:
                doomed.append(aside)
        return doomed

    def close(self) -> None:
        """Drop this process's in-flight folder and lock (also done by the next start)."""
        shutil.rmtree(self._partial, ignore_errors=True)
        with suppress(FileNotFoundError):
            self._owner_lock.unlink()
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1
