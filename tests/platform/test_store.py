"""Adapter store (local folder, S3 over a real moto server) and the engine-side disk cache."""

from __future__ import annotations

import random
import secrets
import shutil
import threading
import time
from pathlib import Path

import boto3
import pytest

from loraplex.platform.store import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterCache,
    AdapterNotFound,
    AdapterStore,
    LocalStore,
    StoreError,
    adapter_digest,
    make_store,
)
from loraplex.platform.store.s3 import S3Store
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, free_port, moto_server

MiB = 1024 * 1024


def fake_adapter(folder: Path, seed: int = 0, weights_bytes: int = 4096) -> Path:
    """Two files with adapter names; the store never looks inside them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(f'{{"r": 4, "seed": {seed}}}')
    (folder / WEIGHTS_FILE).write_bytes(random.Random(seed).randbytes(weights_bytes))
    return folder


def same_files(a: Path, b: Path) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in ADAPTER_FILES)


# --- digest and make_store ---------------------------------------------------------------


def test_digest_depends_on_content_only(tmp_path):
    a = fake_adapter(tmp_path / "a", seed=1)
    b = fake_adapter(tmp_path / "b", seed=1)
    (b / "README.md").write_text("not part of the adapter")
    assert adapter_digest(a) == adapter_digest(b)
    # Moving bytes from one file to the other must change the digest (length-prefixed).
    c = tmp_path / "c"
    c.mkdir()
    (c / CONFIG_FILE).write_bytes((a / CONFIG_FILE).read_bytes()[:-1])
    (c / WEIGHTS_FILE).write_bytes(
        (a / CONFIG_FILE).read_bytes()[-1:] + (a / WEIGHTS_FILE).read_bytes()
    )
    assert adapter_digest(c) != adapter_digest(a)
    (b / WEIGHTS_FILE).write_bytes(b"\x00" + (a / WEIGHTS_FILE).read_bytes()[1:])
    assert adapter_digest(b) != adapter_digest(a)


def test_make_store_urls(tmp_path):
    assert make_store(tmp_path / "plain").root == tmp_path / "plain"
    assert make_store(f"file://{tmp_path}/url").root == tmp_path / "url"
    s3 = make_store("s3://my-bucket/some/prefix/", endpoint_url="http://127.0.0.1:1", region=REGION)
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("my-bucket", "some/prefix")
    with pytest.raises(StoreError, match="unsupported scheme 'ftp'"):
        make_store("ftp://host/x")
    with pytest.raises(StoreError, match="no bucket"):
        make_store("s3:///prefix")


# --- local store ---------------------------------------------------------------------------


def test_local_round_trip_and_layout(tmp_path):
    store = LocalStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    key = store.put(src, digest)
    assert store.exists(key) and key.startswith(f"{digest}-")
    assert sorted(p.name for p in (tmp_path / "store" / digest[:2] / key).iterdir()) == sorted(
        ADAPTER_FILES
    )
    assert [o.key for o in store.list_objects()] == [key]
    out = store.fetch(key, tmp_path / "out" / "adapter")
    assert out == tmp_path / "out" / "adapter" and same_files(src, out)
    assert list((tmp_path / "out").iterdir()) == [out]  # no temp folder left beside it
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []
    with pytest.raises(StoreError, match="already exists"):
        store.fetch(key, out)


def test_local_puts_of_the_same_bytes_are_objects_of_their_own(tmp_path):
    """No object is shared: deleting one adapter's object never touches another's."""
    store = LocalStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    a, b = store.put(src, digest), store.put(src, digest)
    assert a != b and store.exists(a) and store.exists(b)
    store.delete(a)
    assert not store.exists(a) and store.exists(b)
    assert same_files(src, store.fetch(b, tmp_path / "out"))
    other = fake_adapter(tmp_path / "other", seed=2)
    with pytest.raises(ValueError, match="not the"):
        store.put(other, "0" * 64)
    assert [o.key for o in store.list_objects()] == [b]  # the refused put left nothing
    for bad in ("../../etc", digest + "\n", digest + "-../x", digest.upper()):
        with pytest.raises(ValueError, match="not an adapter store key"):
            store.exists(bad)


def test_local_delete(tmp_path):
    store = LocalStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    key = store.put(src, adapter_digest(src))
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(AdapterNotFound):
        store.fetch(key, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    store.delete(key)  # deleting again is fine
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []
    shutil.rmtree(tmp_path / "store")  # the whole folder gone: a StoreError, not an OSError
    for call in (lambda: store.put(src, adapter_digest(src)), lambda: store.delete(key)):
        with pytest.raises(StoreError, match="cannot"):
            call()


# --- S3 over a real moto server ------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_server() as url:
        yield url


def s3_client(endpoint: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


def s3_store(endpoint: str, url: str, **kw) -> AdapterStore:
    return make_store(
        url,
        endpoint_url=endpoint,
        region=REGION,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        **kw,
    )


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"adapters-{secrets.token_hex(4)}"
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("prefix", ["", "team/adapters"])
def test_s3_round_trip(s3_endpoint, bucket, tmp_path, prefix):
    store = s3_store(s3_endpoint, f"s3://{bucket}/{prefix}")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    assert not store.exists(digest)
    key = store.put(src, digest)
    assert store.exists(key) and key.startswith(f"{digest}-")
    assert [o.key for o in store.list_objects()] == [key]
    listed = s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    base = f"{prefix}/{key}" if prefix else key
    assert sorted(o["Key"] for o in listed) == sorted(f"{base}/{n}" for n in ADAPTER_FILES)
    out = store.fetch(key, tmp_path / "out" / "a")
    assert same_files(src, out) and list((tmp_path / "out").iterdir()) == [out]
    store.delete(key)
    assert not store.exists(key)
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    with pytest.raises(AdapterNotFound):
        store.fetch(key, tmp_path / "gone")


def test_s3_large_file_goes_multipart(s3_endpoint, bucket, tmp_path):
    # 11 MiB over a 1 MiB threshold goes up in the store's 8 MiB parts: 2 of them.
    store = s3_store(s3_endpoint, f"s3://{bucket}/mp", multipart_threshold=1 * MiB)
    src = fake_adapter(tmp_path / "src", weights_bytes=11 * MiB)
    key = store.put(src, adapter_digest(src))
    head = s3_client(s3_endpoint).head_object(Bucket=bucket, Key=f"mp/{key}/{WEIGHTS_FILE}")
    assert head["ContentLength"] == 11 * MiB
    assert head["ETag"].strip('"').endswith("-2")  # a multipart object's ETag counts parts
    assert same_files(src, store.fetch(key, tmp_path / "out"))


def test_s3_config_marks_a_complete_adapter(s3_endpoint, bucket, tmp_path):
    """A put that died after the weights leaves nothing that looks like an adapter, but an
    object the collector can see."""
    store = s3_store(s3_endpoint, f"s3://{bucket}")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    s3_client(s3_endpoint).upload_file(str(src / WEIGHTS_FILE), bucket, f"{digest}/{WEIGHTS_FILE}")
    assert not store.exists(digest)
    with pytest.raises(AdapterNotFound):
        store.fetch(digest, tmp_path / "out")
    assert [o.key for o in store.list_objects()] == [digest]
    key = store.put(src, digest)
    assert same_files(src, store.fetch(key, tmp_path / "out"))
    store.delete(digest)
    assert [o.key for o in store.list_objects()] == [key]


def test_s3_missing_bucket_says_so(s3_endpoint, tmp_path):
    store = s3_store(s3_endpoint, "s3://no-such-bucket/x")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    for call in (store.check, lambda: store.exists(digest), lambda: store.put(src, digest)):
        with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist.*create it"):
            call()
    with pytest.raises(StoreError, match="does not exist"):
        store.fetch(digest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_s3_bad_credentials_say_what_to_check(tmp_path):
    with moto_server(auth=True) as endpoint:
        store = make_store(
            "s3://adapters", endpoint_url=endpoint, region=REGION, access_key="AKIAWRONG",
            secret_key="wrong",
        )  # fmt: skip
        src = fake_adapter(tmp_path / "src")
        with pytest.raises(StoreError, match="access denied.*check the access key and secret"):
            store.put(src, adapter_digest(src))


def test_s3_unreachable_endpoint(tmp_path):
    store = s3_store(f"http://127.0.0.1:{free_port()}", "s3://adapters")
    with pytest.raises(StoreError, match="cannot reach the S3 endpoint"):
        store.check()


# --- the disk cache ------------------------------------------------------------------------


class CountingStore(LocalStore):
    """A local store whose fetch is slow and counted, to expose duplicate downloads."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.fetches = 0

    def fetch(self, key: str, dest: Path) -> Path:
        self.fetches += 1
        time.sleep(0.2)
        return super().fetch(key, dest)


def test_cache_downloads_once_under_concurrency(tmp_path):
    store = CountingStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    key = store.put(src, adapter_digest(src))
    cache = AdapterCache(store, tmp_path / "cache", max_bytes=10 * MiB)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get(key, key[:64]))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.fetches == 1 and len(set(results)) == 1 and len(results) == 8
    assert same_files(src, results[0])
    assert (cache.stats.loads, cache.stats.hits) == (1, 7)
    # A new process finds the folder on disk and does not download again.
    again = AdapterCache(store, tmp_path / "cache", max_bytes=10 * MiB)
    assert again.get(key, key[:64]) == results[0] and store.fetches == 1


def test_cache_refuses_a_corrupt_object(s3_endpoint, bucket, tmp_path):
    store = s3_store(s3_endpoint, f"s3://{bucket}/c")
    src = fake_adapter(tmp_path / "src")
    key = store.put(src, adapter_digest(src))
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key=f"c/{key}/{WEIGHTS_FILE}", Body=b"evil")
    cache = AdapterCache(store, tmp_path / "cache", max_bytes=10 * MiB)
    with pytest.raises(StoreError, match="corrupt"):
        cache.get(key, key[:64])
    assert not cache.cached(key[:64])
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".partial"]
    assert list(cache._partial.iterdir()) == []  # our in-flight folder, left empty


def test_cache_evicts_least_recently_used_but_not_pinned(tmp_path):
    store = CountingStore(tmp_path / "store")
    keys = []
    for i in range(4):
        src = fake_adapter(tmp_path / f"src{i}", seed=i, weights_bytes=100_000)
        keys.append(store.put(src, adapter_digest(src)))
    a, b, c, d = keys
    size = sum((tmp_path / "src0" / n).stat().st_size for n in ADAPTER_FILES)
    cache = AdapterCache(store, tmp_path / "cache", max_bytes=2 * size + 10)  # room for two
    cache.get(a, a[:64])
    cache.get(b, b[:64])
    cache.get(a, a[:64])  # a is now the most recent
    cache.get(c, c[:64])  # evicts b
    assert [cache.cached(k[:64]) for k in keys] == [True, False, True, False]
    assert not (tmp_path / "cache" / b).exists() and cache.total_bytes <= 2 * size + 10
    with cache.use(a, a[:64]) as folder:  # a is the LRU entry now, but in use
        cache.get(d, d[:64])
        assert folder.is_dir() and same_files(tmp_path / "src0", folder)
    assert [cache.cached(k[:64]) for k in keys] == [True, False, False, True]
    assert cache.stats.evictions == 2 and store.fetches == 4


# --- one cache folder shared by several processes -------------------------------------------


def _cache_in_child(store_root: str, cache_dir: str, key: str, conn) -> None:
    cache = AdapterCache(LocalStore(Path(store_root)), cache_dir, max_bytes=10 * MiB)
    conn.send(str(cache.get(key, key[:64])))
    conn.send(cache._partial.name)
    conn.recv()  # stay alive (holding the owner lock) until told to go


def _spawn_cache(ctx, store_root, cache_dir, key):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cache_in_child, args=(str(store_root), str(cache_dir), key, child))
    proc.start()
    return proc, parent


def test_processes_sharing_a_cache_keep_each_others_work(tmp_path):
    """A starting process removes only dead owners' in-flight files; a folder a neighbour
    published is adopted (checked), not downloaded again."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    store = CountingStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    key = store.put(src, adapter_digest(src))
    cache_dir = tmp_path / "cache"
    proc, conn = _spawn_cache(ctx, tmp_path / "store", cache_dir, key)
    try:
        folder, owner = Path(conn.recv()), conn.recv()
        live = cache_dir / ".partial" / owner
        (live / "download-in-flight").mkdir()  # stands for a download the neighbour is doing
        dead = cache_dir / ".partial" / "12345-dead"
        (dead / "half").mkdir(parents=True)
        (cache_dir / ".partial" / "12345-dead.lock").touch()  # its owner is gone: lock free
        ours = AdapterCache(store, cache_dir, max_bytes=10 * MiB)
        assert (live / "download-in-flight").is_dir(), "a live neighbour's download was removed"
        assert not dead.exists() and not (cache_dir / ".partial" / "12345-dead.lock").exists()
        assert ours.get(key, key[:64]) == folder and same_files(src, folder)
        assert store.fetches == 0 and ours.stats.adopted == 1
        conn.send("go")
        proc.join(30)
        # Its lock is free now: the next start takes its leftovers.
        AdapterCache(store, cache_dir, max_bytes=10 * MiB)
        assert not live.exists()
    finally:
        proc.kill()
        proc.join()


def test_a_damaged_folder_is_replaced_whole_and_an_evicted_one_fetched_again(tmp_path):
    """The CI failure this guards: a process killed while it removed a published folder in
    place left one without its weights, which neighbours then served (422) forever."""
    store = CountingStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "src")
    digest = adapter_digest(src)
    key = store.put(src, digest)
    cache_dir = tmp_path / "cache"
    half = cache_dir / digest  # the cache is keyed by content
    half.mkdir(parents=True)
    (half / CONFIG_FILE).write_text((src / CONFIG_FILE).read_text())  # weights missing
    cache = AdapterCache(store, cache_dir, max_bytes=10 * MiB)
    assert cache.cached(digest)  # listed at start, checked before first use
    folder = cache.get(key, digest)
    assert folder == half and same_files(src, folder) and store.fetches == 1
    # A neighbour sharing the folder evicts it: the next use fetches it again, whole.
    shutil.rmtree(folder)
    assert same_files(src, cache.get(key, digest)) and store.fetches == 2
    # Two caches racing to publish the same digest: both end up with one whole folder.
    other = AdapterCache(store, cache_dir, max_bytes=10 * MiB)
    shutil.rmtree(folder)
    results = []
    threads = [
        threading.Thread(target=lambda c=c: results.append(c.get(key, digest)))
        for c in (cache, other)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [folder, folder] and same_files(src, folder)
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([".partial", digest])
    for c in (cache, other):
        c.close()
    assert list((cache_dir / ".partial").iterdir()) == []
