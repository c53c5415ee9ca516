"""The disk tier shared by the workers of one host.

The disk tier's index (engine/memory/tiers/stores.py DiskStore) knows the records this
process wrote and those in the folder when it started: enough for a restart, not for a
decode worker reading what a prefill worker in another process wrote a moment ago. A worker
of either role reads its disk tier through `SharedDiskStore`, which looks a key it does not
know up in the folder itself (a record is renamed into place whole, so a file that exists
is complete; keys.decode checks it all the same).
"""

from __future__ import annotations

from loraplex.engine.memory.tiers.stores import DiskStore


class SharedDiskStore(DiskStore):
    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        for k in keys:
            h = k.hex()
            with self._lock:
                if h in self._index:
                    continue
            try:
                size = self._path(h).stat().st_size
            except FileNotFoundError:
                break  # a prefix is useless past a gap
            with self._lock:
                if h not in self._index:
                    self._index[h] = size
                    self.nbytes += size
        return super().get_many(keys)


def share_disk_tier(engine) -> None:
    """Make `engine`'s disk tier, if any, read what other processes write to its folder."""
    tiers = engine.kv_tiers
    for store in tiers.stores if tiers is not None else []:
        if type(store) is DiskStore:
            store.__class__ = SharedDiskStore  # same folder and index, reads widened
