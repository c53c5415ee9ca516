"""Scheduler: token budget, sequence and adapter-slot caps, chunked prefill, preemption, abort.

Most tests drive a Scheduler + BlockManager with a fake model (`_Sim`) that writes each
computed token's KV into its slot and, whenever a sequence samples, reads back the KV of all
its positions as attention would, so a wrong block table or a bad prefix hit fails loudly.
Its next token depends only on the sequence's tokens, so a run's outputs must not depend on
batching, chunking or preemption. Two tests use the real engine with the tiny llama.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceStatus
from testkit.factories import make_adapter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # EngineConfig only reads config.json; the scheduler needs no weights.
    d = tmp_path_factory.mktemp("config_only")
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return str(d)


def make_scheduler(
    model_dir: str,
    num_blocks: int = 64,
    block_size: int = 8,
    prefix_caching: bool = True,
    **options,
) -> Scheduler:
    config = EngineConfig(
        model=model_dir, block_size=block_size, enable_prefix_caching=prefix_caching, **options
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/nowhere/{i}")


class _Sim:
    """Steps a scheduler as LLMEngine does; the 'model' checks the KV it reads."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.bs = sched.block_manager.block_size
        self.kv: dict[int, int] = {}  # slot -> digest of what was computed there
        self.arrivals = itertools.count()
        self.seqs: list[Sequence] = []

    def add(
        self,
        prompt: list[int],
        max_tokens: int = 4,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Sequence:
        seq = Sequence(
            f"r{len(self.seqs)}",
            list(prompt),
            SamplingParams(max_tokens=max_tokens),
            lora=lora,
            tenant=tenant,
            arrival=float(next(self.arrivals)),
        )
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def _slot(self, seq: Sequence, p: int) -> int:
        return seq.block_table[p // self.bs] * self.bs + p % self.bs

    @staticmethod
    def _content(seq: Sequence, p: int) -> int:
        return hash((seq.adapter_id, seq.tenant, tuple(seq.all_token_ids[: p + 1])))

    @staticmethod
    def next_token(seq: Sequence) -> int:
        return 5 + hash(tuple(seq.all_token_ids)) % 400

    def step(self, abort_during_step: Sequence | None = None) -> SchedulerOutput:
        out = self.sched.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert n >= 1
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[self._slot(seq, p)] = self._content(seq, p)
        sampled = {}
        for i, seq in enumerate(out.seqs):
            if out.samples(i):
                for p in range(seq.num_tokens):  # attention over the whole context
                    assert self.kv.get(self._slot(seq, p)) == self._content(seq, p), (
                        f"{seq.request_id}: wrong KV at position {p}"
                    )
                sampled[seq.seq_no] = [self.next_token(seq)]
        if abort_during_step is not None:
            self.sched.finish(abort_during_step, "abort")
        for seq in self.sched.postprocess(out, sampled):
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
        return out

    def run(self, max_steps: int = 2000, on_step=None) -> int:
        """Step until done; `on_step(out, outputs_before, running_before)` checks each step."""
        steps = 0
        while self.sched.has_unfinished():
            outputs = {s.seq_no: list(s.output_token_ids) for s in self.seqs}
            running = list(self.sched.running)
            out = self.step()
            if on_step is not None:
                on_step(out, outputs, running)
            steps += 1
            assert steps < max_steps, "the scheduler stopped making progress"
        return steps


def random_prompts(seed: int, n: int, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 400) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def outputs_of(sim: _Sim) -> list[list[int]]:
    return [s.output_token_ids for s in sim.seqs]


# ---------------------------------------------------------------------------- budget and caps
def test_token_budget_and_seq_cap_hold_and_budget_is_filled(model_dir):
    sched = make_scheduler(
        model_dir, num_blocks=128, prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=4
    )
    sim = _Sim(sched)
    rng = random.Random(0)
    for prompt in random_prompts(0, 12):
        sim.add(prompt, max_tokens=rng.randrange(1, 7))

    while sched.has_unfinished():
        # With blocks to spare, a step uses the whole budget whenever there is that much work.
        running = sum(s.num_tokens - s.num_computed_tokens for s in sched.running)
        free_seats = 4 - len(sched.running)
        queued = sorted(sched.waiting, key=lambda s: s.arrival)[:free_seats]
        work = running + sum(s.num_tokens for s in queued)
        out = sim.step()
        assert out.num_batched_tokens <= 32
        assert len(sched.running) <= 4 and len(out.seqs) <= 4
        assert len({s.seq_no for s in out.seqs}) == len(out.seqs)
        assert out.num_batched_tokens == min(32, work)
    assert [len(o) for o in outputs_of(sim)] == [s.params.max_tokens for s in sim.seqs]
    sched.block_manager.check_all_free()


def test_outputs_do_not_depend_on_budget_or_seq_cap(model_dir):
    prompts = random_prompts(1, 10)
    results = []
    for budget, max_seqs in ((512, 64), (7, 3), (1, 1)):
        sim = _Sim(make_scheduler(model_dir, max_num_batched_tokens=budget, max_num_seqs=max_seqs))
        for p in prompts:
            sim.add(p, max_tokens=5)
        sim.run()
        results.append(outputs_of(sim))
    assert results[0] == results[1] == results[2]


def test_chunked_prefill_splits_long_prompt(model_dir):
    sim = _Sim(make_scheduler(model_dir, max_num_batched_tokens=16))
    seq = sim.add(list(range(10, 50)), max_tokens=3)  # 40 prompt tokens
    chunks = []
    for _ in range(3):
        out = sim.step()
        chunks.append(out.num_new_tokens)
        if len(chunks) < 3:
            assert seq.output_token_ids == [], "no token before the whole prompt is computed"
    assert chunks == [[16], [16], [8]]
    assert len(seq.output_token_ids) == 1
    assert sim.step().num_new_tokens == [1]  # then one token per decode step
    sim.step()
    assert seq.is_finished and len(seq.output_token_ids) == 3


def test_without_chunked_prefill_a_prompt_is_never_split(model_dir):
    sim = _Sim(
        make_scheduler(
            model_dir, enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64
        )
    )
    a, b = sim.add([7] * 40, max_tokens=2), sim.add([8] * 40, max_tokens=2)
    out = sim.step()
    assert out.seqs == [a] and out.num_new_tokens == [40]
    assert b.num_computed_tokens == 0 and b in sim.sched.waiting
    out = sim.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 40]
    sim.run()
    assert [len(s.output_token_ids) for s in (a, b)] == [2, 2]


@pytest.mark.parametrize("budget", [64, 16])
def test_prefill_and_decode_share_a_step(model_dir, budget):
    sim = _Sim(make_scheduler(model_dir, max_num_batched_tokens=budget))
    a = sim.add(list(range(5, 10)), max_tokens=10)
    sim.step()
    sim.step()  # a is decoding now
    b = sim.add(list(range(100, 120)), max_tokens=2)
    out = sim.step()
    # The running decode is never starved by a new prompt; the prompt takes what is left.
    assert out.seqs == [a, b]
    assert out.num_new_tokens == [1, min(20, budget - 1)]


def test_distinct_adapters_running_never_exceed_max_loras(model_dir):
    sched = make_scheduler(model_dir, max_loras=2, max_num_seqs=8, max_num_batched_tokens=64)
    sim = _Sim(sched)
    adapters = [1, 2, 3, None, 1, 4, None, 3, 2, None]
    prompts = [[10 + i] * 4 for i in range(len(adapters))]
    seqs = [
        sim.add(p, max_tokens=3, lora=None if a is None else lora(a))
        for p, a in zip(prompts, adapters, strict=True)
    ]
    out = sim.step()
    # Adapter-less rows and rows of an adapter already in a slot are admitted past blocked ones.
    assert [s.adapter_id for s in out.seqs] == [1, 2, 0, 1, 0, 2, 0]
    assert seqs[2] in sched.waiting and seqs[5] in sched.waiting

    def check(out: SchedulerOutput, *_) -> None:
        assert len(sched.running_adapters()) <= 2
        assert len({s.adapter_id for s in out.seqs if s.adapter_id}) <= 2

    check(out)
    sim.run(on_step=check)
    assert all(len(s.output_token_ids) == 3 for s in seqs), "blocked adapters run later"


# ---------------------------------------------------------------------------- preemption
def _tight_sim(model_dir: str, prefix_caching: bool, num_blocks: int = 8) -> _Sim:
    """Four requests whose 36-token peaks need 20 blocks between them, in a pool of 8."""
    sim = _Sim(make_scheduler(model_dir, num_blocks=num_blocks, prefix_caching=prefix_caching))
    for p in random_prompts(3, 4, 10, 16):
        sim.add(p, max_tokens=20)
    return sim


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_requeues_victim_and_keeps_its_tokens(model_dir, prefix_caching):
    roomy = _tight_sim(model_dir, prefix_caching, num_blocks=64)
    roomy.run()
    assert roomy.sched.num_preemptions == 0
    sim = _tight_sim(model_dir, prefix_caching)
    sched = sim.sched
    victims = []

    def check(out: SchedulerOutput, outputs: dict, running: list[Sequence]) -> None:
        for v in out.preempted:
            victims.append(v)
            assert v.status is SequenceStatus.WAITING and v in sched.waiting
            assert v not in out.seqs and v not in sched.running
            assert v.num_computed_tokens == 0 and v.block_table == []
            assert v.output_token_ids == outputs[v.seq_no], "generated tokens are kept"
            # FCFS: the latest arrival among the running yields.
            assert all(s.arrival < v.arrival for s in running if s not in out.preempted)

    sim.run(on_step=check)
    assert victims and sim.sched.num_preemptions == len(victims)
    assert outputs_of(sim) == outputs_of(roomy)
    sim.sched.block_manager.check_all_free()


def test_no_newer_request_is_admitted_in_a_step_that_preempts(model_dir):
    jumps = []

    def check(out: SchedulerOutput, _outputs, running: list[Sequence]) -> None:
        admitted = [s for s in out.seqs if s not in running]
        for v in out.preempted:
            jumps.extend((s.request_id, v.request_id) for s in admitted if s.arrival > v.arrival)

    sim = _tight_sim(model_dir, prefix_caching=False)
    sim.run(on_step=check)
    assert sim.sched.num_preemptions > 0
    assert jumps == [], f"(newer request admitted, older request preempted): {jumps}"


# ---------------------------------------------------------------------------- abort and cleanup
def test_finish_frees_waiting_and_running_sequences(model_dir):
    sched = make_scheduler(model_dir, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=24)
    sim = _Sim(sched)
    a = sim.add([9] * 10, max_tokens=6)
    b, c, d = (sim.add(p, max_tokens=6) for p in random_prompts(4, 3, 25, 26))
    sim.step()
    assert sched.running == [a, b] and sched.waiting == [c, d]
    assert b.num_computed_tokens == 14 and len(b.block_table) == 2  # mid-prefill (chunked)
    held = sched.block_manager.num_free_blocks
    sched.finish(b, "abort")
    sched.finish(d, "abort")
    for s in (b, d):
        assert s.is_finished and s.finish_reason == "abort" and s.block_table == []
    assert sched.block_manager.num_free_blocks > held
    assert sched.running == [a] and sched.waiting == [c]
    sched.finish(b, "abort")  # a second finish is a no-op, not a double free
    # Abort while a step is in flight: the step's result is dropped for it.
    out = sim.step(abort_during_step=a)
    assert a in out.seqs and a.is_finished
    assert a.block_table == [] and len(a.output_token_ids) == 1
    sim.run()
    assert len(c.output_token_ids) == 6
    assert not sched.has_unfinished()
    sched.block_manager.check_all_free()


def test_every_block_free_after_run_while_cache_keeps_prefixes(model_dir):
    sched = make_scheduler(model_dir, num_blocks=40, max_num_batched_tokens=32)
    sim = _Sim(sched)
    shared = list(range(100, 124))  # 3 full blocks
    for tail in random_prompts(5, 6, 1, 10):
        sim.add(shared + tail, max_tokens=4)
    sim.run()
    bm = sched.block_manager
    bm.check_all_free()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.cached, "freed blocks keep their prefix-cache entries"
    late = sim.add(shared + [1], max_tokens=2)
    sim.run()
    assert late.num_cached_tokens == 24
    bm.check_all_free()


@pytest.mark.parametrize("seed", range(3))
def test_random_mixed_traffic_keeps_every_limit_and_output(model_dir, seed):
    """Shared prefixes across adapters and tenants, arrivals while others run, few slots."""
    rng = random.Random(seed)
    shared = random_prompts(seed, 1, 16, 24)[0]
    # The same prefix under different adapters / tenants must not share KV; within one it may.
    groups = [
        (shared, None, None),
        (shared, 1, "t1"),
        (shared, 1, "t2"),
        (shared, 2, "t1"),
        (random_prompts(seed + 1, 1, 16, 24)[0], 3, None),
    ]
    requests = []
    for _ in range(16):
        prefix, adapter, tenant = rng.choice(groups)
        tail = random_prompts(rng.random(), 1, 1, 9)[0]
        requests.append(
            (prefix[: rng.randrange(8, 24)] + tail, rng.randrange(1, 10), adapter, tenant)
        )

    def run(num_blocks: int) -> _Sim:
        sim = _Sim(
            make_scheduler(
                model_dir,
                num_blocks=num_blocks,
                max_num_batched_tokens=24,
                max_num_seqs=5,
                max_loras=2,
            )
        )
        arrivals = random.Random(seed)
        pending = list(requests)

        def arrive() -> None:
            prompt, max_tokens, adapter, tenant = pending.pop(0)
            sim.add(prompt, max_tokens, None if adapter is None else lora(adapter), tenant)

        def check(out: SchedulerOutput, *_) -> None:
            assert out.num_batched_tokens <= 24 and len(sim.sched.running) <= 5
            assert len(sim.sched.running_adapters()) <= 2
            if pending and arrivals.random() < 0.5:
                arrive()

        while pending:
            arrive()
            sim.run(on_step=check)
        sim.sched.block_manager.check_all_free()
        return sim

    tight, roomy = run(num_blocks=8), run(num_blocks=256)
    assert tight.sched.num_preemptions > 0 and roomy.sched.block_manager.prefix_hits > 0
    outputs = {s.request_id: s.output_token_ids for s in roomy.seqs}
    assert {s.request_id: s.output_token_ids for s in tight.seqs} == outputs
    assert [len(o) for o in outputs.values()] == [r[1] for r in requests]


# ---------------------------------------------------------------------------- real engine
def _drain(engine) -> dict:
    done = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def test_engine_abort_frees_blocks_and_adapter(tiny_models, tmp_path):
    adapter = make_adapter(tiny_models["llama"], tmp_path / "qv", r=4, seed=3)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_lora_rank=8, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    req = LoRARequest("qv", 1, str(adapter))
    for i in range(3):
        engine.add_request(f"r{i}", [1, 20 + i, 30, 40], params, req)
    assert engine.adapters.refs == {1: 3}
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    running = engine.abort("r0")
    waiting = engine.abort("r2")
    for out, n_tokens in ((running, 1), (waiting, 0)):
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert len(out.outputs[0].token_ids) == n_tokens
    assert engine.abort("r0") is None and engine.abort("unknown") is None
    assert engine.adapters.refs == {1: 1}
    done = _drain(engine)
    assert list(done) == ["r1"] and len(done["r1"].outputs[0].token_ids) == 8
    assert engine.adapters.refs == {} and engine.requests == {}
    engine.block_manager.check_all_free()


def test_engine_preemption_completes_with_same_tokens(tiny_models):
    path = str(tiny_models["llama"])
    prompts = random_prompts(6, 4, 12, 16)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    roomy = LLM(path, dtype="float32", max_model_len=32)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(path, dtype="float32", max_model_len=32, block_size=8, num_kv_blocks=5)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0, "5 blocks cannot hold 4 x 24+ tokens"
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    tight.engine.block_manager.check_all_free()
