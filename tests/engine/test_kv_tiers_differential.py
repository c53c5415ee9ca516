"""The differential net (tests/engine/test_differential.py) with KV tiers: greedy outputs still
match transformers + peft when the second batch's prefixes come back from a tier.

Each example draws an engine configuration and two batches as the differential test does
(preemption, swap, chunked prefill, speculation, slot churn, prompt logprobs...), with prefix
caching on (the tiers store its blocks), and one of:

    host / disk / shared   the engine has only that tier; between the batches its device
                           prefix cache is emptied, so the second batch's shared prefixes can
                           only come from the tier
    two engines            the second batch runs on a second engine that shares the first's
                           Redis: the first engine's work reaches it only through the store

Every row of both batches must be the reference's greedy continuation, logprobs within 1e-4
(the same checks as the differential test). The last test checks that the examples did load
blocks from every tier, so the net cannot pass by never hitting. Redis is the real
server at 127.0.0.1:6379; the modes that need it are left out, saying so, where none runs.
Few examples (`LORAPLEX_DIFF_TIER_EXAMPLES`, default 30): the configurations are the
differential test's, which covers them at length; what is new here is only where KV comes from.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from loraplex.engine import LLM
from tests.engine.test_differential import (
    EVERY_FEATURE,
    _check,
    _followups,
    _generate,
    _with_extra,
    cases,
)
from tests.utils.hf_reference import peft_reference

EXAMPLES = int(os.environ.get("LORAPLEX_DIFF_TIER_EXAMPLES", "30"))
REDIS = "redis://127.0.0.1:6379/0"
KIND = "llama"


def _redis_up() -> bool:
    try:
        import redis

        redis.Redis.from_url(REDIS, socket_timeout=1).ping()
    except Exception:  # noqa: BLE001 (no client or no server: the Redis modes are left out)
        return False
    return True


MODES = ("host", "disk", "shared", "two engines") if _redis_up() else ("host", "disk")
HITS: Counter[str] = Counter()  # blocks loaded from a tier, per mode


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adapters(tiny_models, tiny_adapters, tmp_path_factory) -> dict[str, dict]:
    """The differential test's seven adapters per kind (conftest's four and its extra three)."""
    return _with_extra(tiny_models, tiny_adapters, tmp_path_factory.mktemp("tier-adapters"))


def _every_mode(test):
    """The differential test's everything-at-once case in each mode: its follow-ups share
    long prefixes, so each mode loads blocks whatever the drawn examples do."""
    for mode in MODES:
        test = example(case=EVERY_FEATURE, mode=mode)(test)
    return test


def _engine(base, case, tiers: dict) -> LLM:
    return LLM(
        str(base),
        dtype="float32",
        max_loras=case.max_loras,
        max_lora_rank=case.max_lora_rank,
        max_cpu_loras=case.max_cpu_loras,
        block_size=case.block_size,
        num_kv_blocks=case.num_kv_blocks,
        max_model_len=case.max_model_len,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.max_num_seqs,
        enable_chunked_prefill=case.enable_chunked_prefill,
        enable_prefix_caching=True,
        scheduling_policy=case.scheduling_policy,
        cpu_attention=case.cpu_attention,
        num_host_kv_blocks=case.num_host_kv_blocks,
        preemption_mode=case.preemption_mode,
        num_speculative_tokens=case.num_speculative_tokens,
        kv_admission=case.kv_admission,
        **tiers,
    )


def _evict(llm: LLM) -> None:
    """Drop the device pool's prefix cache, as reusing every cached block would."""
    bm = llm.engine.block_manager
    bm.cached.clear()
    for b in bm.blocks:
        b.key = None


def _close(llm: LLM) -> None:
    llm.engine.adapters.close()
    if llm.engine.kv_tiers is not None:
        llm.engine.kv_tiers.close()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(case=cases(), mode=st.sampled_from(MODES))
@_every_mode
def test_outputs_match_hf_peft_with_kv_from_the_tiers(case, mode, tiny_models, adapters, tmp_path):
    base, folders = tiny_models[KIND], adapters[KIND]
    peft = peft_reference(base, folders)
    salt = uuid.uuid4().hex  # this example's keys only
    tiers = {
        "host": dict(kv_tier_host_gib=0.01),
        "disk": dict(kv_tier_disk_path=str(tmp_path / f"kv-{salt}")),
        "shared": dict(kv_tier_shared_url=REDIS),
        "two engines": dict(kv_tier_shared_url=REDIS),
    }[mode]
    tiers["kv_tier_salt"] = salt
    a = _engine(base, case, tiers)
    engines = [a]
    try:
        first = [(list(r.prompt), r.adapter, r.max_tokens, r.ignore_eos) for r in case.first]
        asks = case.prompt_logprobs
        outs = _generate(a, folders, first, asks)
        _check(peft, first, outs, "first", asks)
        a.engine.kv_tiers.flush()
        second = _followups(case, first, outs)
        if mode == "two engines":
            engines.append(_engine(base, case, tiers))
        else:
            _evict(a)
        b = engines[-1]
        outs2 = _generate(b, folders, second, asks) if second else []
        _check(peft, second, outs2, "second", asks)
        loaded = b.engine.kv_tiers.tokens_loaded // case.block_size
        if loaded:
            event(f"blocks loaded: {mode}")
        HITS[mode] += loaded
    finally:
        for llm in engines:
            _close(llm)


def test_generated_examples_load_from_every_tier(tiny_models, adapters, tmp_path_factory):
    """The examples did load blocks from each mode's tier: the net cannot pass by missing."""
    if not HITS:  # selected on its own (-k): run the generated examples first
        test_outputs_match_hf_peft_with_kv_from_the_tiers(
            tiny_models=tiny_models, adapters=adapters, tmp_path=tmp_path_factory.mktemp("kv")
        )
    missing = [m for m in MODES if not HITS[m]]
    assert not missing, f"no generated example loaded blocks from: {missing} ({dict(HITS)})"
