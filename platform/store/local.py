"""A folder as the adapter store: `<root>/<digest[:2]>/<digest>/{adapter_config.json, ...}`.

Writers build each adapter in `<root>/.tmp/` (same filesystem) and `os.replace` it into
place; deleters move it out before removing it. A reader therefore sees a complete adapter
folder or none, also across processes sharing the folder.

    root/
      .tmp/put-…/          being written (stale ones older than a day are swept at start)
      3f/3f9a…e1/          adapter_config.json, adapter_model.safetensors
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from loraplex.platform.store.base import (
    ADAPTER_FILES,
    CONFIG_FILE,
    AdapterNotFound,
    AdapterStore,
    StoreError,
    check_digest,
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
        check_digest(key)
        return self.root / key[:2] / key

    def put(self, folder: Path, digest: str) -> str:
        final = self._folder(digest)
        if (final / CONFIG_FILE).is_file():
            return digest  # content-addressed: same digest, same bytes
        folder = Path(folder)
        tmp = Path(tempfile.mkdtemp(prefix="put-", dir=self._tmp))
        try:
            for name in ADAPTER_FILES:
                copy_durably(folder / name, tmp / name)
            # Hash what landed on our disk, not the source: that is what readers will get.
            verify_digest(tmp, digest)
            final.parent.mkdir(exist_ok=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if not (final / CONFIG_FILE).is_file():
                    raise
                # A concurrent put of the same digest won the rename; its copy is identical.
        except OSError as e:
            raise StoreError(f"cannot write adapter {digest} into {self.root}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return digest

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
        trash = Path(tempfile.mkdtemp(prefix="del-", dir=self._tmp)) / key
        try:
            os.replace(final, trash)  # atomic: readers never see a half-removed adapter
        except FileNotFoundError:
            pass
        finally:
            shutil.rmtree(trash.parent, ignore_errors=True)

    def exists(self, key: str) -> bool:
        return all((self._folder(key) / name).is_file() for name in ADAPTER_FILES)

    def check(self) -> None:
        try:
            with tempfile.NamedTemporaryFile(dir=self._tmp):
                pass
        except OSError as e:
            raise StoreError(
                f"adapter store folder {self.root} is not writable ({e.strerror}): "
                "check its permissions"
            ) from None
