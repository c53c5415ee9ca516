"""KV tier keys and records (engine/memory/tiers/keys.py) and the stores' concurrency
(engine/memory/tiers/stores.py): every input of the key separates, a record that is not whole
and its key's is a miss, and concurrent writers of one key leave one whole record."""

from __future__ import annotations

import threading
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine import LoRARequest
from loraplex.engine.memory.tiers import keys as K
from loraplex.engine.memory.tiers.stores import DiskStore, HostStore, RedisStore

PARTS = st.fixed_dictionaries(
    {
        "model": st.sampled_from([b"m1", b"m2"]),
        "layout": st.sampled_from(["[8,f32]", "[8,int8]", "[16,f32]"]),
        "adapter": st.sampled_from([b"base", b"a" * 32, b"b" * 32]),
        "tenant": st.sampled_from([None, "", "t1", "t2", "t1|"]),
        "salt": st.sampled_from(["", "s1", "s2"]),
        "chain": st.sampled_from([b"\0" * 16, b"\1" * 16]),
    }
)


def _key(p: dict) -> bytes:
    ns = K.namespace(p["model"], p["layout"], p["adapter"], p["tenant"], p["salt"])
    return K.store_key(ns, p["chain"])


@settings(max_examples=300, deadline=None)
@given(a=PARTS, b=PARTS)
def test_store_keys_separate_every_input(a, b):
    """Keys agree exactly when every input does (None and "" are one tenant: no tenant)."""
    same = {**a, "tenant": a["tenant"] or ""} == {**b, "tenant": b["tenant"] or ""}
    assert (_key(a) == _key(b)) == same


def test_adapter_digest_follows_the_weights(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"x" * 64)
    lora = LoRARequest("a", 1, str(folder))
    first = K.adapter_digest(lora)
    assert K.adapter_digest(lora) == first
    (folder / "adapter_model.safetensors").write_bytes(b"y" * 65)
    assert K.adapter_digest(lora) != first
    assert K.adapter_digest(None) == b"base"


@given(
    payload=st.binary(min_size=1, max_size=64),
    flip=st.integers(0, 10**6),
    cut=st.integers(1, 200),
)
def test_any_damaged_record_is_a_miss(payload, flip, cut):
    key, other = b"k" * 32, b"o" * 32
    rec = K.encode(key, payload)
    assert K.decode(key, rec, len(payload)) == payload
    assert K.decode(other, rec, len(payload)) is None  # another key's record
    assert K.decode(key, rec, len(payload) + 1) is None  # another layout's size
    assert K.decode(key, rec[: -min(cut, len(rec))], len(payload)) is None
    bad = bytearray(rec)
    bad[flip % len(bad)] ^= 1 << (flip % 8)
    assert K.decode(key, bytes(bad), len(payload)) is None
    assert K.decode(key, None, len(payload)) is None


def _hammer(store, key: bytes, payloads: list[bytes]) -> None:
    """Writers of one key race (each writing several times) while a reader reads: every read
    is a whole record of one writer, and so is what is left."""
    seen, errors = [], []

    def write(p):
        for _ in range(20):
            store.put(key, K.encode(key, p))

    def read():
        for _ in range(100):
            rec = store.get_many([key])[0]
            if rec is not None:
                got = K.decode(key, rec, len(payloads[0]))
                (seen if got in payloads else errors).append(got)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert K.decode(key, store.get_many([key])[0], len(payloads[0])) in payloads


PAYLOADS = [bytes([i]) * 4096 for i in range(6)]


def test_concurrent_writers_of_one_key_on_disk(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    _hammer(store, b"d" * 32, PAYLOADS)
    assert not list(tmp_path.glob("*/*.tmp"))
    # A writer killed mid-write leaves a temporary: the next start removes it, keeps the rest.
    (next(tmp_path.glob("*")) / ".dead.tmp").write_bytes(b"half")
    again = DiskStore(tmp_path, max_bytes=1 << 20)
    assert not list(tmp_path.glob("*/*.tmp")) and again.get_many([b"d" * 32])[0] is not None


def test_concurrent_writers_of_one_key_on_redis():
    redis = pytest.importorskip("redis")
    try:
        redis.Redis(socket_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at 127.0.0.1:6379: {e}")
    store = RedisStore("redis://127.0.0.1:6379/0", ttl_s=60, prefix=f"lpkv-test-{uuid.uuid4()}:")
    _hammer(store, b"r" * 32, PAYLOADS)


def test_bounded_stores_drop_the_least_recently_used(tmp_path):
    host = HostStore(max_bytes=3 * 1000)
    disk = DiskStore(tmp_path, max_bytes=3 * 1000)
    for store in (host, disk):
        for i in range(3):
            store.put(bytes([i]) * 32, b"x" * 1000)
        store.get_many([b"\0" * 32])  # touch the oldest
        store.put(b"\3" * 32, b"x" * 1000)
        assert store.get_many([b"\1" * 32]) == [None]
        assert store.get_many([b"\0" * 32])[0] is not None
        assert store.nbytes == 3000
