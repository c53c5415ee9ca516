"""KV-aware admission (engine/scheduling/admission.py) and the fair-share victim of least
recompute."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.scheduling.admission import KVAdmission, OutputLengthEstimator
from loraplex.engine.scheduling.policy import FCFSPolicy, VTCPolicy
from loraplex.engine.sequence import LoRARequest, Sequence


def _seq(tenant, adapter, prompt_len, outputs=0, max_tokens=None, computed=0, arrival=0.0):
    lora = LoRARequest(f"a{adapter}", adapter, "/nowhere") if adapter else None
    s = Sequence("r", [3] * prompt_len, SamplingParams(max_tokens=max_tokens), lora=lora,
                 tenant=tenant, arrival=arrival)  # fmt: skip
    s.output_token_ids = [4] * outputs
    s.num_computed_tokens = computed
    return s


def test_estimator_learns_per_tenant_and_adapter_with_fallbacks():
    est = OutputLengthEstimator()
    assert est.mean(_seq("t1", 1, 5)) is None  # nothing learned: admission by prompt
    for n in (100, 300):
        est.observe(_seq("t1", 1, 5, outputs=n))
    est.observe(_seq("t2", 0, 5, outputs=20))
    assert est.mean(_seq("t1", 1, 5)) == 200
    assert est.mean(_seq("t1", 7, 5)) == 200  # an adapter not seen: the tenant's mean
    assert est.mean(_seq("t2", 0, 5)) == 20
    assert est.mean(_seq("t3", 0, 5)) == pytest.approx(140)  # a new tenant: everyone's


def test_expected_tokens_is_capped_and_grows_with_the_output():
    adm = KVAdmission(BlockManager(64, 16), max_model_len=512)
    for _ in range(3):
        adm.on_finished(_seq("t", 0, 5, outputs=200), "length")
    adm.on_finished(_seq("t", 0, 5, outputs=5000), "abort")  # aborts teach nothing
    assert adm.expected_tokens(_seq("t", 0, 10)) == 10 + 200
    assert adm.expected_tokens(_seq("t", 0, 10, max_tokens=50)) == 10 + 50  # max_tokens caps
    assert adm.expected_tokens(_seq("t", 0, 400)) == 512  # so does the context length
    # Past the mean: at least one more block than it has now.
    assert adm.expected_tokens(_seq("t", 0, 10, outputs=250)) == 10 + 250 + 16


def test_vtc_victim_is_the_heaviest_tenants_cheapest_request():
    policy = VTCPolicy(slot_slack=1e9)
    light = _seq("light", 0, 8, computed=2, arrival=3.0)  # cheapest of all, newest of all
    heavy_old = _seq("heavy", 0, 90, computed=40, arrival=1.0)
    heavy_new = _seq("heavy", 0, 90, computed=300, arrival=2.0)
    for s in (heavy_old, heavy_new, light):
        policy.on_arrival(s)
    for s in (heavy_old, heavy_new, light):
        policy.on_admitted(s)  # charges each prompt: heavy's counter is the larger
    assert policy.preemption_victim([heavy_old, heavy_new, light]) is heavy_old
    assert policy.preemption_victim([light]) is light


def test_fcfs_least_recompute_victim_spares_the_oldest():
    oldest = _seq("t", 0, 8, computed=1, arrival=0.0)  # cheapest, but must keep going
    resumed = _seq("t", 0, 8, computed=16, arrival=1.0)  # re-admitted after a preemption
    newest = _seq("t", 0, 8, computed=200, arrival=2.0)
    running = [oldest, resumed, newest]
    assert FCFSPolicy().preemption_victim(running) is newest  # latest arrival, by default
    assert FCFSPolicy(least_recompute=True).preemption_victim(running) is resumed
    assert FCFSPolicy(least_recompute=True).preemption_victim([oldest]) is oldest


def _long_outputs(llm: LLM, n: int, prompt_len: int, max_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (prompt_len,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_kv_admission_avoids_preemption_with_the_same_outputs(tiny_models):
    """A pool of 20 blocks of 16; 8 requests of 20 + 60 tokens (5 blocks each at the end).
    Admitted by prompt, all 8 start and preempt one another as they grow; admitted by the
    learned output length (60, from two earlier requests), 4 run at a time and none is
    preempted. Greedy outputs are the same either way."""
    runs = {}
    for kv_admission in (False, True):
        llm = LLM(str(tiny_models["llama"]), dtype="float32", cpu_attention="sdpa",
                  max_model_len=128, num_kv_blocks=20, block_size=16, max_lora_rank=8,
                  max_num_seqs=8, kv_admission=kv_admission)  # fmt: skip
        _long_outputs(llm, 2, 20, 60, seed=1)  # finished requests to learn from
        sched = llm.engine.scheduler
        before = sched.num_preemptions
        outs = _long_outputs(llm, 8, 20, 60, seed=2)
        runs[kv_admission] = (outs, sched.num_preemptions - before)
    assert runs[False][1] > 0 and runs[True][1] == 0, runs
    assert runs[True][0] == runs[False][0]
