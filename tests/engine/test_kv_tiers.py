"""KV tiers below the device pool (engine/memory/tiers): greedy outputs identical with tiers on
and off, each tier evicted to and reloaded from, two engines reusing each other's prefix through
one Redis, entries surviving a restart, a corrupt block a miss, a lookup that waits never
holding up other requests, and no hit ever crossing tenants or adapter versions.

Runs are float32 and greedy on the tiny llama; "evict" empties the device pool's prefix cache
(every block's key dropped, as the LRU does to blocks it reuses), so the next request's prefix
can only come from a tier. Redis is the real server at 127.0.0.1:6379 (skipped, saying so,
where none runs); each test salts its keys (kv_tier_salt) so runs never see each other's."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import threading
import uuid

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loraplex.engine import LLM, LoRARequest, SamplingParams

REDIS = "redis://127.0.0.1:6379/0"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def redis_url():
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS, socket_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {REDIS}: {e}")
    return REDIS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompt(seed: int, n: int = 70) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(model, **kw) -> LLM:
    base = dict(dtype="float32", block_size=8, max_model_len=256, max_lora_rank=16)
    return LLM(str(model), **{**base, **kw})


def _run(llm: LLM, prompt, lora=None, tenant=None, salt=None) -> list[int]:
    """One greedy request's tokens; its blocks' writes to the tiers are done on return."""
    engine = llm.engine
    params = GREEDY if salt is None else dataclasses.replace(GREEDY, cache_salt=salt)
    engine.add_request(uuid.uuid4().hex, prompt, params, lora, tenant=tenant)
    tokens = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    if engine.kv_tiers is not None:
        engine.kv_tiers.flush()
    engine.block_manager.check_all_free()
    return tokens


def _evict(llm: LLM) -> None:
    """Drop the device pool's prefix cache, as reusing every cached block would."""
    bm = llm.engine.block_manager
    bm.cached.clear()
    for b in bm.blocks:
        b.key = None


def _computed(llm: LLM, prompt, **kw) -> tuple[list[int], int]:
    """One request's tokens and the prompt tokens the model had to compute for it."""
    before = llm.engine.num_prompt_tokens_computed
    tokens = _run(llm, prompt, **kw)
    return tokens, llm.engine.num_prompt_tokens_computed - before


def _salt() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = _llm(tiny_models["llama"])

    def want(prompt, lora=None):
        return _run(llm, prompt, lora)

    return want


@pytest.mark.parametrize("tier", ["host", "disk", "shared"])
def test_evicted_prefix_reloads_from_each_tier(tier, tiny_models, reference, tmp_path, request):
    """Only `tier` configured: after eviction, a later turn's history comes back from it, the
    model computes only the new tokens, and the tokens are those of a run without tiers."""
    opts = {
        "host": dict(kv_tier_host_gib=0.01),
        "disk": dict(kv_tier_disk_path=str(tmp_path / "kv")),
        "shared": dict(kv_tier_shared_url=request.getfixturevalue("redis_url")),
    }[tier]
    llm = _llm(tiny_models["llama"], kv_tier_salt=_salt(), **opts)
    history = _prompt(1)
    first = _run(llm, history)
    assert first == reference(history)
    _evict(llm)
    turn = history + first + _prompt(2, 11)
    tokens, computed = _computed(llm, turn)
    assert tokens == reference(turn)
    c = llm.engine.kv_tiers.counters[tier]
    stored = (len(history) + len(first) - 1) // 8  # full computed blocks of the first turn
    assert c.hits == stored
    assert computed == len(turn) - stored * 8


def test_two_engines_share_one_redis(tiny_models, tiny_adapters, reference, redis_url):
    """Replica B serves the next turn of a conversation replica A started: A's blocks come
    from Redis, for the base model and for an adapter, and B's tokens equal a lone run's."""
    salt, lora = _salt(), LoRARequest("qv4", 1, str(tiny_adapters["llama"]["qv4"]))
    a = _llm(tiny_models["llama"], kv_tier_shared_url=redis_url, kv_tier_salt=salt)
    b = _llm(tiny_models["llama"], kv_tier_shared_url=redis_url, kv_tier_salt=salt)
    for adapter in (None, lora):
        history = _prompt(3)
        first = _run(a, history, adapter)
        turn = history + first + _prompt(4, 9)
        shared = b.engine.kv_tiers.counters["shared"]
        hits, written = shared.hits, shared.blocks_written
        tokens, computed = _computed(b, turn, lora=adapter)
        assert tokens == reference(turn, adapter)
        stored = (len(history) + len(first) - 1) // 8
        assert shared.hits - hits == stored
        assert computed == len(turn) - stored * 8, "B recomputed A's history"
        # B writes back only the blocks it computed, not the ones it loaded.
        assert shared.blocks_written - written == (len(turn) + 5) // 8 - stored


def test_entries_survive_a_restart(tiny_models, reference, tmp_path):
    kw = dict(kv_tier_disk_path=str(tmp_path / "kv"), kv_tier_salt=_salt())
    history = _prompt(5)
    first = _run(_llm(tiny_models["llama"], **kw), history)
    again = _llm(tiny_models["llama"], **kw)  # a new engine on the same folder
    turn = history + first
    tokens, computed = _computed(again, turn)
    assert tokens == reference(turn)
    stored = (len(turn) - 1) // 8
    assert again.engine.kv_tiers.counters["disk"].hits == stored
    assert computed == len(turn) - stored * 8


def test_corrupt_and_truncated_blocks_are_misses(tiny_models, reference, tmp_path):
    """A flipped byte in one stored block, and another block cut short: the prefix stops
    before the first bad one; the tokens are still exact."""
    kw = dict(kv_tier_disk_path=str(tmp_path / "kv"), kv_tier_salt=_salt())
    history = _prompt(6)
    _run(_llm(tiny_models["llama"], **kw), history)
    files = sorted(p for p in (tmp_path / "kv").glob("*/*"))  # in no chain order
    assert len(files) == (len(history) + GREEDY.max_tokens - 1) // 8
    data = bytearray(files[3].read_bytes())
    data[-5] ^= 0x40
    files[3].write_bytes(bytes(data))
    files[5].write_bytes(files[5].read_bytes()[:-100])
    llm = _llm(tiny_models["llama"], **kw)
    tokens, computed = _computed(llm, history)
    assert tokens == reference(history)
    c = llm.engine.kv_tiers.counters["disk"]
    # One of the two bad blocks is among the 8 the prompt looks up: the lookup stops there.
    assert c.invalid == 1 and c.hits < 8
    assert computed == len(history) - c.hits * 8


def test_a_waiting_lookup_holds_up_no_one(tiny_models, tmp_path):
    """While a request's lookup is stuck in a slow store, another request runs to the end."""
    llm = _llm(tiny_models["llama"], kv_tier_host_gib=0.01, kv_tier_salt=_salt())
    tiers, gate = llm.engine.kv_tiers, threading.Event()
    host = tiers.stores[0]
    get_many = host.get_many
    host.get_many = lambda keys: (gate.wait(30), get_many(keys))[1]
    engine = llm.engine
    engine.add_request("slow", _prompt(7), GREEDY)
    engine.add_request("free", _prompt(8, 5), GREEDY)  # no full block: no lookup
    finished = []
    for _ in range(40):
        finished += [o.request_id for o in engine.step() if o.finished]
        if "free" in finished:
            break
    assert finished == ["free"]
    assert engine.scheduler.waiting and engine.scheduler.waiting[0].request_id == "slow"
    gate.set()
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["free", "slow"]


@pytest.fixture(scope="module")
def crossing(tiny_models, tiny_adapters, tmp_path_factory):
    """One engine with a host tier; adapters "qv4" v1 and v2 (same name, new weights)."""
    root = tmp_path_factory.mktemp("versions")
    v1 = tiny_adapters["llama"]["qv4"]
    v2 = shutil.copytree(v1, root / "qv4-v2")
    weights = v2 / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    adapters = {
        None: None,
        "v1": LoRARequest("qv4", 1, str(v1)),
        "v2": LoRARequest("qv4", 2, str(v2)),
        "other": LoRARequest("attn8", 3, str(tiny_adapters["llama"]["attn8"])),
    }
    return _llm(tiny_models["llama"], kv_tier_host_gib=0.01, kv_tier_salt=_salt()), adapters


WHO = st.tuples(
    st.sampled_from([None, "t1", "t2"]),
    st.sampled_from([None, "v1", "v2", "other"]),
    st.sampled_from([None, "salt-1", "salt-2"]),  # the tenant's cache salt, before and after
)
PROMPTS = itertools.count(1000)  # a fresh prompt per example: no example sees another's blocks


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(writer=WHO, reader=WHO)
@example(writer=("t1", "v1", None), reader=("t1", "v1", None))  # the hit others must not get
@example(writer=("t1", "v1", None), reader=("t1", "v2", None))  # same adapter name, new version
@example(writer=("t1", None, None), reader=("t2", None, None))
@example(writer=("t1", None, "salt-1"), reader=("t1", None, "salt-2"))  # a rotated salt
@example(writer=("t1", None, "salt-1"), reader=("t2", None, "salt-1"))  # one salt, two tenants
def test_no_hit_crosses_tenants_or_adapter_versions(crossing, writer, reader):
    """Adversarial: a prefix written under (tenant, adapter version, cache salt) is found by a
    reader under exactly the same triple and by no other."""
    llm, adapters = crossing
    prompt = _prompt(next(PROMPTS), 33)
    _run(llm, prompt, adapters[writer[1]], tenant=writer[0], salt=writer[2])
    _evict(llm)
    hits = llm.engine.kv_tiers.counters["host"].hits
    _run(llm, prompt, adapters[reader[1]], tenant=reader[0], salt=reader[2])
    found = llm.engine.kv_tiers.counters["host"].hits - hits
    assert found == (4 if reader == writer else 0)
    _evict(llm)


def test_a_new_adapter_version_under_the_same_name_and_id_misses(crossing, tiny_models, tmp_path):
    """The chain key names an adapter by its id alone: an embedder that reuses the id for new
    weights (another replica, a restart) must still miss, by the version digest in the key."""
    _, adapters = crossing
    v1, v2 = adapters["v1"], adapters["v2"]
    v2 = LoRARequest(v1.lora_name, v1.lora_int_id, v2.lora_path)  # same name and id
    kw = dict(kv_tier_disk_path=str(tmp_path / "kv"), kv_tier_salt=_salt())
    prompt = _prompt(9, 41)
    _run(_llm(tiny_models["llama"], **kw), prompt, v1)
    for lora, want in ((v2, 0), (v1, 5)):
        llm = _llm(tiny_models["llama"], **kw)
        _run(llm, prompt, lora)
        assert llm.engine.kv_tiers.counters["disk"].hits == want


def test_stats_and_metrics_show_each_tier(tiny_models, tmp_path):
    """The engine's snapshot carries per-tier counters and /metrics' gauges show them."""
    from prometheus_client import generate_latest

    from loraplex.engine.snapshot import engine_stats
    from loraplex.platform.metrics import Metrics

    llm = _llm(tiny_models["llama"], kv_tier_host_gib=0.01, kv_tier_disk_path=str(tmp_path))
    history = _prompt(11)
    _run(llm, history)
    _evict(llm)
    _run(llm, history)
    stats = engine_stats(llm.engine, alive=True)
    assert stats.kv_tier_hits == {"host": 8, "disk": 0}
    # Asked twice (a miss in every tier, then all 8 in host); disk only the first time.
    assert stats.kv_tier_queried == {"host": 16, "disk": 8}
    assert stats.kv_tier_bytes_written["disk"] == stats.kv_tier_bytes_stored["disk"] > 0
    assert stats.kv_tier_tokens_loaded == 64
    metrics = Metrics()
    metrics.refresh(stats)
    text = generate_latest(metrics.registry).decode()
    assert 'loraplex_kv_tier_blocks{kind="hit",tier="host"} 8.0' in text
    assert 'loraplex_kv_tier_bytes{kind="stored",tier="disk"}' in text


def test_an_unreachable_shared_store_is_only_a_miss(tiny_models, reference):
    """A replica whose Redis is down (nothing listens on the port) serves as without tiers."""
    pytest.importorskip("redis")
    llm = _llm(tiny_models["llama"], kv_tier_shared_url="redis://127.0.0.1:1/0")
    history = _prompt(12)
    assert _run(llm, history) == reference(history)
    _evict(llm)
    tokens, computed = _computed(llm, history)
    assert tokens == reference(history) and computed == len(history)
    c = llm.engine.kv_tiers.counters["shared"]
    assert c.errors >= 2 and c.hits == 0


def test_a_cache_salt_separates_device_and_tier_hits(tiny_models, reference):
    """Requests share cached KV (device pool and tiers) only under the same cache_salt, the
    per-tenant secret the platform rotates; an unsalted request is a third party."""
    from loraplex.engine.errors import BadRequestError

    llm = _llm(tiny_models["llama"], kv_tier_host_gib=0.01, kv_tier_salt=_salt())
    engine, host = llm.engine, llm.engine.kv_tiers.counters["host"]
    history = _prompt(13)

    def run(salt):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)
        out = llm.generate([history], params)[0]
        engine.kv_tiers.flush()
        assert out.outputs[0].token_ids == reference(history)
        return out.num_cached_tokens

    assert run("a") == 0
    assert run("a") == 64  # the device pool's blocks, same salt
    assert run("b") == 0 and run(None) == 0  # nor a device hit nor a tier hit
    _evict(llm)
    hits = host.hits
    assert run("c") == 0 and host.hits == hits  # a new salt: nothing stored under it
    assert run("a") == 64 and host.hits == hits + 8  # the old salt's blocks, from the tier
    with pytest.raises(BadRequestError, match="cache_salt"):
        SamplingParams(cache_salt=5)


def test_the_cache_salt_crosses_into_the_engine_process():
    """A server's engine runs in a child process: the salt survives the command pipe's JSON."""
    import json

    from loraplex.engine.core import AddRequest
    from loraplex.engine.process.engine_process import _command, _encode_command

    sent = AddRequest("r", [1, 2], SamplingParams(cache_salt="s" * 64), None, "7", 1.0)
    got = _command(json.loads(json.dumps(_encode_command(sent))))
    assert got.params.cache_salt == "s" * 64 and got.tenant == "7"
