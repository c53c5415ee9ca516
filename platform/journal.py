"""The ledger's local journal: what the database could not take yet, kept on this server's
disk until it can (platform/ledger.py writes and replays it).

A SQLite file of the standard library's sqlite3, not a hand-rolled append-only file: each
add is one transaction, fsynced before it returns (synchronous=FULL), a write torn by a crash
is rolled back by SQLite's own recovery, and a replayed entry is deleted by key instead of
rewriting a log. The entries are JSON, never pickles.

An entry's key is unique: the first entry of a key is kept (the ledger's "first record of a
request wins"), a second add of the same key changes nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Entry:
    key: str  # the request id of a usage record; "release:<request id>" for a release
    kind: str  # "usage" or "release" (platform/ledger.py)
    payload: dict[str, Any]


class Journal:
    """Entries in the order they were added. Safe from any thread."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # WAL: an add appends to the log; FULL: that append is fsynced before commit returns.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "key TEXT NOT NULL UNIQUE, kind TEXT NOT NULL, payload TEXT NOT NULL)"
        )
        self._count = self._db.execute("SELECT count(*) FROM entries").fetchone()[0]

    def add(self, entry: Entry) -> bool:
        """Keep `entry` durably; False if an entry of its key is already kept."""
        payload = json.dumps(entry.payload, separators=(",", ":"))
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO entries (key, kind, payload) VALUES (?, ?, ?)",
                (entry.key, entry.kind, payload),
            )
            added = cursor.rowcount == 1
            self._count += added
        return added

    def oldest(self, limit: int = 100) -> list[Entry]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, kind, payload FROM entries ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        return [Entry(key, kind, json.loads(payload)) for key, kind, payload in rows]

    def remove(self, key: str) -> None:
        with self._lock:
            cursor = self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
            self._count -= cursor.rowcount

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        with self._lock:
            self._db.close()
