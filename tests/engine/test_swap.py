"""Preemption by swap (engine/memory/swap.py): a host KV pool, and measured costs that choose swap
or recompute. Every run here is float32 and greedy, so a preempted request must produce the
tokens it produces when nothing is preempted, with the same log-probabilities; the one
allowance is an exact tie (random tiny weights have some: two tokens within float32 rounding
of each other), where a step's other rows, which change the order of a matmul's sums by an
ulp, may pick either (`_same`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.memory.swap import KV_TENSORS, SwapCosts
from loraplex.engine.scheduling.scheduler import SchedulerOutput

ADAPTERS = (None, "qv4", "attn8", "mlp16", "all2")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
TIE = 1e-5  # top two log-probabilities this close: an exact tie up to float32 rounding


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only spins
    yield
    torch.set_num_threads(threads)


def _prompts(n: int, shared: int = 0) -> list[list[int]]:
    """`n` prompts of 20-41 token ids, the first `shared` ids common to all (prefix cache)."""
    g = torch.Generator().manual_seed(7)
    head = torch.randint(5, 500, (shared,), generator=g).tolist()
    return [head + torch.randint(5, 500, (20 + 3 * i,), generator=g).tolist() for i in range(n)]


def _loras(folders: dict, n: int) -> list[LoRARequest | None]:
    names = [ADAPTERS[i % len(ADAPTERS)] for i in range(n)]
    return [None if a is None else LoRARequest(a, ADAPTERS.index(a), str(folders[a]))
            for a in names]  # fmt: skip


def _llm(model, **kw) -> LLM:
    base = dict(dtype="float32", max_loras=4, max_lora_rank=16, block_size=8, max_model_len=96)
    return LLM(str(model), **{**base, **kw})


def _generate(llm: LLM, prompts, loras, params=GREEDY) -> list[list[tuple[list[int], list]]]:
    """Per prompt, per sample: (token ids, each step's top log-probabilities)."""
    outs = llm.generate(prompts, params, loras)
    engine = llm.engine
    engine.block_manager.check_all_free()
    if engine.scheduler.swap is not None:
        engine.scheduler.swap.check_all_free()
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def _same(got, want) -> None:
    """The same greedy tokens with log-probabilities within 1e-4, except that a sample may
    part from the reference at an exact tie of the reference's top two tokens (and is not
    compared past it)."""
    assert len(got) == len(want)
    for samples, ref_samples in zip(got, want, strict=True):
        for (tokens, lps), (ref, ref_lps) in zip(samples, ref_samples, strict=True):
            assert len(tokens) == len(ref)
            pairs = enumerate(zip(tokens, ref, strict=True))
            j = next((i for i, (a, b) in pairs if a != b), len(ref))
            for i in range(j):
                assert abs(lps[i][ref[i]] - ref_lps[i][ref[i]]) < 1e-4, i
            if j < len(ref):
                top = sorted(ref_lps[j].values(), reverse=True)
                assert top[0] - top[1] < TIE, (j, ref_lps[j], lps[j])


@pytest.fixture(scope="module")
def roomy(tiny_models, tiny_adapters):
    """Outputs without any preemption: the reference for every constrained run."""
    llm = _llm(tiny_models["llama"])
    folders = tiny_adapters["llama"]
    cache = {}

    def want(prompts, params=GREEDY):
        key = (str(prompts), params.n)
        if key not in cache:
            cache[key] = _generate(llm, prompts, _loras(folders, len(prompts)), params)
            assert llm.engine.scheduler.num_preemptions == 0
        return cache[key]

    return want


@pytest.mark.parametrize("shared", [0, 16], ids=["distinct", "shared-prefix"])
def test_swap_preemption_same_outputs_and_frees_everything(
    shared, tiny_models, tiny_adapters, roomy
):
    prompts = _prompts(6, shared)
    llm = _llm(tiny_models["llama"], num_kv_blocks=14, num_host_kv_blocks=64,
               preemption_mode="swap")  # fmt: skip
    got = _generate(llm, prompts, _loras(tiny_adapters["llama"], len(prompts)))
    swap = llm.engine.scheduler.swap
    assert llm.engine.scheduler.num_preemptions > 0, "14 blocks of 8 must force preemption"
    assert swap.num_swapped_in > 0 and swap.num_swapped_in == swap.num_swapped_out
    assert swap.blocks_out > 0
    _same(got, roomy(prompts))


def test_int8_cache_swap_same_outputs(tiny_models, tiny_adapters):
    """With the int8 cache, swapped-in blocks carry their scales: the same tokens as an int8
    run that never preempts."""
    prompts, loras = _prompts(6), _loras(tiny_adapters["llama"], 6)
    want = _generate(_llm(tiny_models["llama"], kv_cache_dtype="int8"), prompts, loras)
    llm = _llm(tiny_models["llama"], kv_cache_dtype="int8", num_kv_blocks=14,
               num_host_kv_blocks=64, preemption_mode="swap")  # fmt: skip
    _same(_generate(llm, prompts, loras), want)
    assert llm.engine.scheduler.swap.num_swapped_in > 0


def test_forked_samples_under_swap(tiny_models, tiny_adapters, roomy):
    """n = 3 samples share their prompt's blocks (reference counts > 1) when preempted."""
    prompts = _prompts(3, shared=8)
    params = dataclasses.replace(GREEDY, n=3, max_tokens=16)
    llm = _llm(tiny_models["llama"], num_kv_blocks=16, num_host_kv_blocks=48,
               preemption_mode="swap")  # fmt: skip
    got = _generate(llm, prompts, _loras(tiny_adapters["llama"], 3), params)
    assert llm.engine.scheduler.swap.num_swapped_in > 0
    _same(got, roomy(prompts, params))


def test_full_host_pool_falls_back_to_recompute(tiny_models, tiny_adapters, roomy):
    prompts = _prompts(6)
    llm = _llm(tiny_models["llama"], num_kv_blocks=14, num_host_kv_blocks=6,
               preemption_mode="swap")  # fmt: skip
    got = _generate(llm, prompts, _loras(tiny_adapters["llama"], len(prompts)))
    swap = llm.engine.scheduler.swap
    assert swap.num_swapped_out > 0 and swap.num_recomputed > 0
    _same(got, roomy(prompts))


@pytest.mark.parametrize("copy_s", [1.0, 0.0], ids=["copy-expensive", "copy-cheap"])
def test_cost_model_picks_recompute_or_swap(copy_s, tiny_models, tiny_adapters, roomy):
    """preemption_mode "auto": the measured costs decide. Made expensive (1 s a block each
    way), no victim is swapped; free, every victim with computed tokens is."""
    prompts = _prompts(6)
    llm = _llm(tiny_models["llama"], num_kv_blocks=14, num_host_kv_blocks=64)
    swap = llm.engine.scheduler.swap
    assert swap.mode == "auto" and swap.costs.out_per_block_s > 0  # measured at start
    swap.costs.out_per_block_s = swap.costs.in_per_block_s = copy_s
    swap.costs.out_fixed_s = swap.costs.in_fixed_s = 0.0
    got = _generate(llm, prompts, _loras(tiny_adapters["llama"], len(prompts)))
    preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0 and swap.costs.prefill_per_token_s > 0  # from the runner's steps
    if copy_s:
        assert swap.num_swapped_out == 0 and swap.num_recomputed == preemptions
    else:
        assert swap.num_swapped_out > 0 and swap.num_swapped_in == swap.num_swapped_out
    _same(got, roomy(prompts))


def test_cost_model_arithmetic():
    costs = SwapCosts(out_fixed_s=1e-4, out_per_block_s=1e-5, in_fixed_s=1e-4,
                      in_per_block_s=2e-5)  # fmt: skip
    assert costs.recompute_s(100) is None and not costs.prefers_swap(1, 100)  # nothing seen
    costs.observe_step(8, 0.002)
    costs.observe_step(8, 0.003)  # steps of one size only: no slope yet
    assert costs.prefers_swap(1, 100) is False and costs.prefill_per_token_s is None
    for tokens in (100, 40, 8):  # 1 ms a step + 0.12 ms a token
        costs.observe_step(tokens, 1e-3 + tokens * 1.2e-4)
    costs.steps.popleft(), costs.steps.popleft()  # drop the noisy pair, refit
    costs.observe_step(8, 1e-3 + 8 * 1.2e-4)
    assert costs.prefill_per_token_s == pytest.approx(1.2e-4)
    costs.observe_step(2, 0.5)  # a spike that makes the fit fall: the last slope stays
    assert costs.prefill_per_token_s == pytest.approx(1.2e-4)
    # 10 blocks: 2e-4 + 10 x 3e-5 = 5e-4 s to swap; 80 tokens: 9.6e-3 s to recompute.
    assert costs.swap_s(10) == pytest.approx(5e-4)
    assert costs.prefers_swap(10, 80)
    assert not costs.prefers_swap(10, 4)  # 4.8e-4 s of recompute is cheaper


def test_abort_of_a_swapped_out_request_returns_its_host_blocks(tiny_models):
    llm = _llm(tiny_models["llama"], num_kv_blocks=14, num_host_kv_blocks=64,
               preemption_mode="swap")  # fmt: skip
    engine = llm.engine
    for i, p in enumerate(_prompts(6)):
        engine.add_request(f"r{i}", p, GREEDY)
    swap = engine.scheduler.swap
    for _ in range(200):
        engine.step()
        if swap.tables:
            break
    assert swap.tables, "no request was swapped out"
    victims = [s.request_id for s in engine.scheduler.waiting if swap.is_swapped(s)]
    for rid in victims:
        engine.abort(rid)
    assert not swap.tables
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_all_free()
    swap.check_all_free()


def test_int8_swap_brings_back_values_and_scales_exactly(tiny_models):
    """Swapped-in blocks hold the int8 values and their float16 scales bit for bit, though the
    device blocks they left were overwritten in between. (No prefix cache: its blocks would
    be shared again on swap-in, not copied.)"""
    llm = _llm(tiny_models["llama"], kv_cache_dtype="int8", num_host_kv_blocks=16,
               preemption_mode="swap", enable_prefix_caching=False)  # fmt: skip
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("a", _prompts(1)[0], GREEDY)
    for _ in range(5):
        engine.step()
    (seq,) = sched.running
    computed, bs = seq.num_computed_tokens, engine.config.block_size
    attns = engine.runner.attentions
    rows = [(seq.block_table[p // bs], p % bs) for p in range(computed)]

    def snapshot(rows):
        return {
            (i, name): torch.stack([getattr(a, name)[b, o] for b, o in rows])
            for i, a in enumerate(attns)
            for name in KV_TENSORS
        }

    before = snapshot(rows)
    assert all(before[(i, "k_scale")].abs().min() > 0 for i in range(len(attns)))
    out = SchedulerOutput()
    sched.running.remove(seq)  # preempt it as a KV shortage would
    sched.running.append(seq)
    sched._preempt(seq, out)
    assert seq.num_computed_tokens == computed and not seq.block_table
    engine.host_kv.swap_out(out.swap_out)
    for a in attns:  # the freed device blocks are reused by others: overwrite every one
        for name in KV_TENSORS:
            getattr(a, name).fill_(3)
    engine.step()  # admits it again: swap-in, then one decode token
    assert seq in sched.running and sched.swap.num_swapped_in == 1
    rows = [(seq.block_table[p // bs], p % bs) for p in range(computed)]
    after = snapshot(rows)
    for key, t in before.items():
        assert torch.equal(after[key], t), key
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_all_free()
    sched.swap.check_all_free()


def test_measured_copy_costs_are_positive_and_per_block(tiny_models):
    llm = _llm(tiny_models["llama"], swap_space_gib=0.001)
    swap = llm.engine.scheduler.swap
    block_bytes = llm.engine.runner.kv_cache_bytes // llm.engine.runner.num_blocks
    assert swap.num_blocks == int(0.001 * 2**30) // block_bytes
    c = swap.costs
    assert c.out_fixed_s + c.out_per_block_s > 0 and c.in_fixed_s + c.in_per_block_s > 0
    assert c.swap_s(10) > c.swap_s(1)
