"""KV tiers below the device pool: write-through of computed prefix blocks, and asynchronous
lookups of a new request's longest stored prefix.

    write   a block the prefix cache registers (full, computed) is gathered to bytes on the
            engine thread right after its step (engine/memory/tiers/layout.py) and queued;
            a writer thread checksums it and writes it to host, disk and the shared store.
            A full queue drops the write (counted): a slow store never slows a step.
            Every tier gets every block (write-through, not spill-on-evict): another replica's
            next turn may need the block while this one still holds it on the device.
    lookup  when a request arrives (Scheduler.add), its prefix's chain keys past what the
            device pool holds go to a lookup thread, which reads host, then disk, then the
            shared store, each from where the one above stopped, keeping the longest run of
            verified records (a hit below host is copied into host). Until it answers, the
            scheduler skips the request (it waits; others run). Admitted, its device hits are
            shared as always, the tier hits are written into fresh blocks before the step
            runs, and only the rest is prefilled.

Requests whose prompt logprobs are asked never look up: their prefix's rows must be computed
to be scored (as with the device prefix cache, Sequence.max_cached_tokens). Echo and
structured output need no logits of the prefix, so they take tier hits as any request does.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from loraplex.engine.memory.tiers import keys as K
from loraplex.engine.memory.tiers.layout import KVLayout

log = logging.getLogger("loraplex.engine.kv_tiers")

WRITE_QUEUE = 256  # batches of blocks waiting for the writer; beyond: dropped, counted
# The most a stopping engine waits for its queued writes (docs/kv-tiers.md): shorter than the
# server's 10 s shutdown grace, so a slow store cannot turn a stop into a kill.
FLUSH_ON_CLOSE_S = 5.0


@dataclass
class TierCounters:
    """Per tier, since start: blocks asked and found, bytes read and written."""

    queried: int = 0
    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    invalid: int = 0  # records found but corrupt, truncated or not the key's: misses
    errors: int = 0  # store unreachable or failing: misses / writes lost


def _failed(c: TierCounters, what: str, tier: str, e: Exception) -> None:
    """Count a store failure; log the 1st, 2nd, 4th, 8th... (a down store fails every block)."""
    c.errors += 1
    if c.errors & (c.errors - 1) == 0:
        log.warning("KV tier %s %s failed (%d failures so far): %s", what, tier, c.errors, e)


@dataclass
class _Lookup:
    start: int  # device blocks the request had when it asked: hits begin here
    payloads: list[bytes] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # their store keys


class KVTiers:
    def __init__(self, stores: list, layout: KVLayout, block_manager, model_id: bytes,
                 salt: str = ""):  # fmt: skip
        self.stores = stores  # top (host) first
        self.layout = layout
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.model_id = model_id
        self.layout_text = K.layout_string(layout.describe())
        self.salt = salt
        self.counters = {s.name: TierCounters() for s in stores}
        self.host = next((s for s in stores if s.name == "host"), None)
        self.dropped_writes = 0
        self._closing = False  # set when a close's flush ran out of time: drop what is left
        self.tokens_loaded = 0  # prompt tokens the tiers spared a prefill
        self._ns: dict[int, bytes] = {}  # seq_no -> its namespace (tenant, adapter version)
        self._pending: set[int] = set()
        self._answered = threading.Condition()  # notified as each lookup answers
        self._results: dict[int, _Lookup] = {}
        self._written: OrderedDict[bytes, None] = OrderedDict()  # recent writes: no repeats
        self._lookups: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._threads = [
            threading.Thread(target=self._lookup_loop, name="kv-tier-lookup", daemon=True),
            threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True),
        ]
        for t in self._threads:
            t.start()
        block_manager.tier_new = []  # the prefix cache reports newly registered blocks here

    # ---------------------------------------------------------------- scheduler side
    def namespace(self, seq) -> bytes:
        ns = self._ns.get(seq.seq_no)
        if ns is None:
            adapter = K.adapter_digest(seq.lora)
            ns = K.namespace(self.model_id, self.layout_text, adapter, seq.tenant, self.salt)
            self._ns[seq.seq_no] = ns
        return ns

    def request(self, seq) -> None:
        """Start looking up `seq`'s stored prefix past the device pool's (engine thread)."""
        if seq.prompt_logprobs is not None or seq.num_computed_tokens or seq.seq_no in self._ns:
            return
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        chain = bm._keys_for(seq, seq.max_cached_tokens // self.block_size)
        start = 0
        while start < len(chain) and chain[start] in bm.cached:
            start += 1
        ns = self.namespace(seq)
        if start == len(chain):
            return
        self._pending.add(seq.seq_no)
        self._lookups.put((seq.seq_no, start, [K.store_key(ns, c) for c in chain[start:]]))

    def take(self, seq, num_device_blocks: int) -> list[bytes] | None:
        """Payloads of the blocks after the device pool's `num_device_blocks` hits, or None
        while the lookup is under way (the request waits)."""
        if seq.seq_no in self._pending:
            return None
        r = self._results.get(seq.seq_no)
        if r is None or num_device_blocks < r.start:  # none, or the device lost blocks since
            return []
        return r.payloads[num_device_blocks - r.start :]

    def admitted(self, seq, num_device_blocks: int, num_loaded: int) -> None:
        """`seq` was admitted with `num_loaded` tier hits after its device hits."""
        r = self._results.pop(seq.seq_no, None)
        if r is not None and num_loaded:  # stored already: the prefix cache must not rewrite
            i = num_device_blocks - r.start
            for sk in r.keys[i : i + num_loaded]:
                self._remember(sk)
        self.tokens_loaded += num_loaded * self.block_size

    def _remember(self, sk: bytes) -> None:
        self._written[sk] = None
        if len(self._written) > 65536:
            self._written.popitem(last=False)

    def forget(self, seq) -> None:
        """`seq` finished: drop what was kept for it (a late lookup answer is dropped too)."""
        self._results.pop(seq.seq_no, None)
        self._ns.pop(seq.seq_no, None)

    def _lookup_loop(self) -> None:
        while True:
            job = self._lookups.get()
            if job is None:
                return
            seq_no, start, store_keys = job
            payloads: list[bytes] = []
            try:
                payloads = self._longest(store_keys)
            except Exception:  # noqa: BLE001 (a miss, never a failed request)
                log.exception("KV tier lookup failed")
            if seq_no in self._ns:  # still alive
                self._results[seq_no] = _Lookup(start, payloads, store_keys[: len(payloads)])
            with self._answered:
                self._pending.discard(seq_no)
                self._answered.notify_all()

    def _longest(self, store_keys: list[bytes]) -> list[bytes]:
        found: list[bytes] = []
        block_bytes = self.layout.block_bytes
        for store in self.stores:
            rest = store_keys[len(found) :]
            if not rest:
                break
            c = self.counters[store.name]
            c.queried += len(rest)
            try:
                records = store.get_many(rest)
            except Exception as e:  # noqa: BLE001 (unreachable store: a miss)
                _failed(c, "lookup in", store.name, e)
                continue
            new = []
            for key, rec in zip(rest, records, strict=True):
                payload = K.decode(key, rec, block_bytes)
                if payload is None:
                    c.invalid += rec is not None
                    break
                new.append((key, rec, payload))
            c.hits += len(new)
            c.bytes_read += sum(len(r) for _, r, _ in new)
            if store is not self.host and self.host is not None:
                for key, rec, _ in new:
                    self.host.put(key, rec)
            found += [p for _, _, p in new]
        return found

    # ---------------------------------------------------------------- engine side
    def offload(self) -> None:
        """Queue the blocks the prefix cache registered this step (after postprocess)."""
        bm = self.block_manager
        new, bm.tier_new = bm.tier_new, []
        block_ids, store_keys = [], []
        for block_id, chain_key, seq in new:
            sk = K.store_key(self.namespace(seq), chain_key)
            if sk in self._written or (self.host is not None and sk in self.host):
                continue
            self._remember(sk)
            block_ids.append(block_id)
            store_keys.append(sk)
        if not block_ids:
            return
        try:
            payloads = self.layout.gather(block_ids)
            self._writes.put_nowait(list(zip(store_keys, payloads, strict=True)))
        except queue.Full:
            self.dropped_writes += len(block_ids)
            for sk in store_keys:
                self._written.pop(sk, None)

    def load(self, pairs: list[tuple[bytes, int]]) -> None:
        """Write tier hits into their device blocks (before the step that attends to them)."""
        self.layout.scatter(pairs)

    def _write_loop(self) -> None:
        while True:
            batch = self._writes.get()
            try:
                if batch is None:
                    return
                for i, (sk, payload) in enumerate(batch):
                    if self._closing:
                        self.dropped_writes += len(batch) - i
                        break
                    rec = K.encode(sk, payload)
                    for store in self.stores:
                        c = self.counters[store.name]
                        try:
                            store.put(sk, rec)
                        except Exception as e:  # noqa: BLE001 (a lost write is only a miss later)
                            _failed(c, "write to", store.name, e)
                            continue
                        c.blocks_written += 1
                        c.bytes_written += len(rec)
            finally:
                self._writes.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is stored, at most `timeout` seconds (None: no
        bound); whether they all were."""
        # Queue.join has no timeout; its own condition and count give one.
        done = self._writes.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._writes.unfinished_tasks, timeout)

    def wait_lookups(self, timeout: float) -> None:
        """Sleep until a lookup answers or `timeout` passes (an otherwise idle step)."""
        with self._answered:
            if self._pending:
                self._answered.wait(timeout)

    def stored_bytes(self) -> dict[str, int]:
        return {s.name: s.nbytes for s in self.stores if hasattr(s, "nbytes")}  # local ones

    def close(self, timeout: float = FLUSH_ON_CLOSE_S) -> bool:
        """Store the queued writes, for at most `timeout` seconds, then stop the threads;
        whether every write was stored. Writes still queued at the bound are dropped
        (counted in dropped_writes): a miss later, never a wrong block."""
        flushed = self.flush(timeout)
        if not flushed:
            self._closing = True
            while True:  # what the writer has not begun is dropped here, not written
                try:
                    batch = self._writes.get_nowait()
                except queue.Empty:
                    break
                if batch is not None:
                    self.dropped_writes += len(batch)
                self._writes.task_done()
            log.warning("KV tiers: stopped with writes unstored after %.1f s (%d blocks "
                        "dropped in all)", timeout, self.dropped_writes)  # fmt: skip
        self._lookups.put(None)
        self._writes.put(None)
        lookup, writer = self._threads
        lookup.join(1.0)  # a lookup in flight ends at the store's socket timeout at worst
        writer.join(1.0 if flushed else 0.0)
        if not writer.is_alive():  # a store still in use by a stuck write stays open
            for s in self.stores:
                s.close()
        return flushed
