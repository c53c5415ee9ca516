"""A folder as the adapter store: `<root>/<key[:2]>/<key>/{adapter_config.json, ...}`.

Writers build each adapter in `<root>/.tmp/` (same filesystem) and `os.replace` it into
place; deleters move it out before removing it. A reader therefore sees a complete adapter
folder or none, also across processes sharing the folder.

    root/
      .tmp/put-…/          being written (stale ones older than a day are swept at start)
      3f/3f9a…e1-07c2…9b/  adapter_config.json, adapter_model.safetensors (key: digest-suffix)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loraplex.platform.store.base import (
    ADAPTER_FILES,
    AdapterNotFound,
    AdapterStore,
    StoredObject,
    StoreError,
    check_key,
    new_key,
    verify_digest,
)

_STALE_S = 24 * 3600


def copy_durably(src: Path, dst: Path) -> None:
    # fsync before the rename that publishes the folder: after a crash, a visible adapter
    # must not turn out to hold zero-length files.
    with src.open("rb") as fin, dst.open("xb") as fout:
        shutil.copyfileobj(fin, fout, 1024 * 1024)
        fout.flush()
        os.fsync(fout.fileno())


class LocalStore(AdapterStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self._tmp = self.root / ".tmp"
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the adapter store folder {self.root} ({e.strerror}): "
                "check the path and its permissions"
            ) from None
        self._sweep()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _sweep(self) -> None:
        # Leftovers of a crashed writer; a day is far longer than any put takes.
        now = time.time()
        for p in self._tmp.iterdir():
            try:
                if now - p.lstat().st_mtime > _STALE_S:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:
                pass

    def _folder(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def _mkdtemp(self, prefix: str, doing: str) -> Path:
        # The store folder itself may be gone (a volume unmounted): a StoreError, as callers
        # expect of every store failure, not a bare OSError.
        try:
            return Path(tempfile.mkdtemp(prefix=prefix, dir=self._tmp))
        except OSError as e:
            raise StoreError(f"cannot {doing} {self.root}: {e.strerror}") from None

    def put(self, folder: Path, digest: str) -> str:
        key = new_key(digest)
        final = self._folder(key)
        folder = Path(folder)
        tmp = self._mkdtemp("put-", f"write adapter {digest} into")
        try:
            for name in ADAPTER_FILES:
                copy_durably(folder / name, tmp / name)
            # Hash what landed on our disk, not the source: that is what readers will get.
            verify_digest(tmp, digest)
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)  # a fresh key: nothing is there to replace
        except OSError as e:
            raise StoreError(f"cannot write adapter {digest} into {self.root}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return key

    def fetch(self, key: str, dest: Path) -> Path:
        src = self._folder(key)
        dest = self._check_dest(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
        try:
            for name in ADAPTER_FILES:
                try:
                    copy_durably(src / name, tmp / name)
                except FileNotFoundError:
                    raise AdapterNotFound(f"no adapter {key} in {self.root}") from None
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def delete(self, key: str) -> None:
        final = self._folder(key)
        trash = self._mkdtemp("del-", f"remove adapter {key} from") / key
        try:
            os.replace(final, trash)  # atomic: readers never see a half-removed adapter
        except FileNotFoundError:
            pass
        finally:
            shutil.rmtree(trash.parent, ignore_errors=True)

    def exists(self, key: str) -> bool:
        return all((self._folder(key) / name).is_file() for name in ADAPTER_FILES)

    def list_objects(self) -> Iterator[StoredObject]:
        for shard in self.root.iterdir():
            if len(shard.name) != 2 or not shard.is_dir():  # .tmp and anything not ours
                continue
            for folder in shard.iterdir():
                try:
                    key = check_key(folder.name)
                    yield StoredObject(key, folder.stat().st_mtime)
                except (ValueError, FileNotFoundError):  # not a key; or deleted meanwhile
                    continue

    def check(self) -> None:
        try:
            with tempfile.NamedTemporaryFile(dir=self._tmp):
                pass
        except OSError as e:
            raise StoreError(
                f"adapter store folder {self.root} is not writable ({e.strerror}): "
                "check its permissions"
            ) from None
