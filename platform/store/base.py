"""The adapter store interface and the content digest (a store for a URL: factory.py).

An adapter is stored as exactly two files, `adapter_config.json` and
`adapter_model.safetensors`. Every `put` files them under a key of their own,
`<digest>-<16 random hex>`, where the digest is the sha256 of both files (`adapter_digest`):
objects are never shared between adapters, even when two uploads (of one tenant or of two)
hold the same bytes. So an object has exactly one registry row for its whole life, deleting an
adapter can remove its object at once without asking who else uses it, and no interleaving of
uploads and deletes (threads, replicas on one database) can remove an object a row still
names. The price is one copy per upload instead of one per content; the gain besides safety is
that one tenant's uploads and deletes are not observable by another through shared objects.
Keys of stores written before this scheme are the bare digest, and stay valid.

Keys are opaque and relative to the store's root, so moving a bucket prefix or a data folder
is a settings change, not a registry migration.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Fixed order: the digest must not depend on how a folder lists its files.
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MiB = 1024 * 1024
_CHUNK = MiB
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[0-9a-f]{64}(-[0-9a-f]{16})?")  # a digest, then the put's own suffix


class StoreError(RuntimeError):
    """The store cannot do what was asked; the message says what to check."""


class AdapterNotFound(StoreError):
    """No complete adapter under this key."""


def check_digest(digest: str) -> str:
    # Digests become folder names and object keys: only 64 lowercase hex characters get there.
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return digest


def check_key(key: str) -> str:
    # Keys become folder names and object keys: nothing but what `new_key` makes gets there.
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"not an adapter store key: {key!r}")
    return key


def new_key(digest: str) -> str:
    """A key no other put has used (64 random bits: a collision is not a practical concern)."""
    return f"{check_digest(digest)}-{secrets.token_hex(8)}"


def key_digest(key: str) -> str:
    """The content digest a key was made for (what the disk cache is keyed by)."""
    return check_key(key)[:64]


@dataclass(frozen=True)
class StoredObject:
    key: str
    modified: float  # seconds since the epoch, when its last file was written


def adapter_digest(folder: str | Path) -> str:
    """sha256 over `len(name) | name | len(data) | data` of both adapter files, lengths as u64.

    Length prefixes make the encoding unambiguous (no two folders hash the same bytes);
    files are streamed, so a large adapter is never held in memory.
    """
    folder = Path(folder)
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = folder / name
        raw = name.encode()
        size = path.stat().st_size
        h.update(struct.pack(">Q", len(raw)) + raw + struct.pack(">Q", size))
        seen = 0
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                seen += len(chunk)
        if seen != size:
            raise StoreError(f"{path} changed while it was being hashed")
    return h.hexdigest()


def verify_digest(folder: Path, digest: str) -> None:
    """Refuse to file content under a digest it does not have (it would poison the store)."""
    actual = adapter_digest(folder)
    if actual != digest:
        raise ValueError(f"{folder} has sha256 {actual}, not the {digest} it is being stored as")


class AdapterStore(ABC):
    """Where adapters live durably. All methods are safe to call from several threads."""

    @abstractmethod
    def put(self, folder: Path, digest: str) -> str:
        """Store `folder`'s two adapter files (whose digest is `digest`) under a new key of
        their own (`new_key`); returns the key. Two puts of the same bytes make two objects."""

    @abstractmethod
    def fetch(self, key: str, dest: Path) -> Path:
        """Write the adapter into the new folder `dest` (it appears complete or not at all)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the adapter; deleting a missing key is not an error."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True when a complete adapter is stored under `key`."""

    @abstractmethod
    def list_objects(self) -> Iterator[StoredObject]:
        """Every object under the store's root, complete or not (a crashed put's leftovers
        included), for the collector of unreferenced objects."""

    @abstractmethod
    def check(self) -> None:
        """Raise StoreError unless the store is reachable and writable (run at startup)."""

    @staticmethod
    def _check_dest(dest: Path) -> Path:
        dest = Path(dest)
        if dest.exists():
            raise StoreError(f"fetch destination {dest} already exists")
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest
