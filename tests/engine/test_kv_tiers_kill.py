"""A replica killed mid-write (SIGKILL, a real process) leaves the shared and disk tiers with
whole records or none: another replica then sees a miss or a whole block, never wrong tokens.

    stores   a child process writes large records to Redis and to a disk folder and is killed
             while it writes; every key then reads as a miss or as one whole record the child
             meant, and a disk store opened afterwards removes the child's temporaries
    engine   a child engine with a shared Redis tier and a disk tier serves a conversation's
             first turn and is killed right after the step that queued its blocks' writes
             (some written, some in flight, some never begun); an engine in this process
             then serves the next turn from what is there, with the tokens of a run
             without tiers

Redis is the real server at 127.0.0.1:6379 (skipped, saying so, where none runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.memory.tiers import keys as K
from loraplex.engine.memory.tiers.stores import DiskStore, RedisStore

REDIS = "redis://127.0.0.1:6379/0"
RECORD = 8 << 20  # large enough that a kill lands inside a write, not between two
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

WRITER = """
import sys
import threading
from loraplex.engine.memory.tiers import keys as K
from loraplex.engine.memory.tiers.stores import DiskStore, RedisStore
url, prefix, folder, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
stores = [RedisStore(url, 60, prefix=prefix), DiskStore(folder, 1 << 40)]
for i in range(10**6):
    key = i.to_bytes(32, "little")
    record = K.encode(key, bytes([i % 251]) * size)
    writes = [threading.Thread(target=s.put, args=(key, record)) for s in stores]
    for w in writes:
        w.start()
    print("put", i, flush=True)  # both stores are writing the record now
    for w in writes:
        w.join()
"""

REPLICA = """
import sys
from loraplex.engine import LLM, SamplingParams
model, url, folder, salt = sys.argv[1:5]
prompt = [int(t) for t in sys.argv[5].split(",")]
llm = LLM(model, dtype="float32", block_size=8, max_model_len=256, max_lora_rank=16,
          kv_tier_shared_url=url, kv_tier_disk_path=folder, kv_tier_salt=salt)
engine = llm.engine
engine.add_request("first", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
while not engine.num_prompt_tokens_computed:  # a first step may only wait for the lookup
    engine.step()
print("queued", flush=True)  # the prefill ran: its full blocks are queued for the writer
sys.stdin.readline()  # the parent kills here
"""


@pytest.fixture(scope="module")
def redis_url():
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS, socket_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {REDIS}: {e}")
    return REDIS


def _child(script: str, *args: str) -> subprocess.Popen:
    # Run from outside the repository: its kernels/ folder would shadow the HF package.
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_a_writer_killed_mid_write_leaves_whole_records_or_none(redis_url, tmp_path):
    after = 3
    prefix, folder = f"lpkv-kill-{uuid.uuid4().hex}:", tmp_path / "kv"
    proc = _child(WRITER, redis_url, prefix, str(folder), str(RECORD))
    try:
        for line in proc.stdout:  # kill as the child begins its `after`-th record's writes
            if line.split()[:2] == ["put", str(after)]:
                break
    finally:
        _kill(proc)
    keys = [i.to_bytes(32, "little") for i in range(after + 2)]
    stores = [RedisStore(redis_url, 60, prefix=prefix), DiskStore(folder, 1 << 40)]
    assert not list(folder.glob("*/*.tmp")), "a new disk store keeps a dead writer's temporary"
    for store in stores:
        found = store.get_many(keys[:after])  # written before the kill: whole
        assert all(K.decode(k, r, RECORD) == bytes([i % 251]) * RECORD
                   for i, (k, r) in enumerate(zip(keys[:after], found, strict=True)))  # fmt: skip
        for i, key in enumerate(keys[after:], after):  # the killed write and after: whole or none
            rec = store.get_many([key])[0]
            assert rec is None or K.decode(key, rec, RECORD) == bytes([i % 251]) * RECORD
        store.close()


def test_a_replica_killed_while_writing_costs_only_a_prefill(tiny_models, redis_url, tmp_path):
    """The killed replica's blocks that reached a store are whole; the next turn, on another
    engine on the same Redis and disk folder, loads what is there and computes the rest."""
    torch = pytest.importorskip("torch")
    model, salt, folder = str(tiny_models["llama"]), uuid.uuid4().hex, tmp_path / "kv"
    history = torch.randint(5, 500, (70,), generator=torch.Generator().manual_seed(56)).tolist()
    proc = _child(REPLICA, model, redis_url, str(folder), salt, ",".join(map(str, history)))
    try:
        assert proc.stdout.readline() == "queued\n"  # the prompt's 8 full blocks are queued
        for _ in range(3000):  # until the child's writer has stored a first block (or 30 s)
            if [f for f in folder.glob("*/*") if not f.name.endswith(".tmp")]:
                break
            time.sleep(0.01)
    finally:
        _kill(proc)
    base = dict(dtype="float32", block_size=8, max_model_len=256, max_lora_rank=16)
    plain = LLM(model, **base)
    turn = history + [7, 8, 9, 10, 11]
    want = plain.generate([turn], GREEDY)[0].outputs[0].token_ids
    tiers = dict(kv_tier_shared_url=redis_url, kv_tier_disk_path=str(folder), kv_tier_salt=salt)
    other = LLM(model, **base, **tiers)
    out = other.generate([turn], GREEDY)[0]
    assert out.outputs[0].token_ids == want
    c = other.engine.kv_tiers.counters
    loaded = other.engine.kv_tiers.tokens_loaded
    assert c["disk"].hits >= 1  # the block the child stored before the kill, at least
    assert c["disk"].invalid == c["shared"].invalid == 0  # nothing half-written was found
    assert loaded == 8 * (c["disk"].hits + c["shared"].hits) <= 8 * 8
    assert other.engine.num_prompt_tokens_computed == len(turn) - loaded
    other.engine.kv_tiers.close()
