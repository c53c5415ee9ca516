"""The batch class (priority 1): admitted only into capacity interactive requests leave free,
preempted first (for KV blocks, sequence seats and adapter slots), within VTC fair share; and
its outputs are the same tokens as without the class (only the order of work changes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine import SamplingParams
from loraplex.engine.sequence import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Sequence
from tests.engine.test_scheduler import _Sim, lora, make_scheduler, model_dir, random_prompts

__all__ = ["model_dir"]  # the fixture, used by name
_arrivals = itertools.count()


def add(sim: _Sim, prompt, *, batch: bool, max_tokens: int = 4, adapter=None, tenant=None):
    seq = Sequence(
        f"{'b' if batch else 'i'}{len(sim.seqs)}",
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        lora=adapter,
        tenant=tenant,
        arrival=float(next(_arrivals)),
        priority=PRIORITY_BATCH if batch else PRIORITY_INTERACTIVE,
    )
    sim.seqs.append(seq)
    sim.sched.add(seq)
    return seq


def test_batch_fills_free_seats_and_yields_them_to_interactive(model_dir):
    sched = make_scheduler(model_dir, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64,
                           max_batch_step_tokens=64)  # fmt: skip
    sim = _Sim(sched)
    batch = [add(sim, p, batch=True, max_tokens=50) for p in random_prompts(1, 6, 4, 10)]
    sim.step()
    assert set(sched.running) == set(batch[:4])  # idle seats go to the batch
    urgent = add(sim, [7, 8, 9], batch=False)
    out = sim.step()
    # The interactive request is admitted at the very next step, taking a batch line's seat.
    assert urgent in sched.running and urgent in out.seqs
    assert len(out.preempted) == 1 and out.preempted[0].priority == PRIORITY_BATCH
    assert len(sched.running) == 4


def test_no_batch_line_is_admitted_while_interactive_waits(model_dir):
    # Two seats; interactive requests keep both busy: the batch never starts before they end.
    sched = make_scheduler(model_dir, num_blocks=256, max_num_seqs=2)
    sim = _Sim(sched)
    fg = [add(sim, p, batch=False, max_tokens=3) for p in random_prompts(2, 6, 4, 10)]
    bg = add(sim, [11, 12, 13], batch=True, max_tokens=3)

    def check(out, _outputs, _running):
        if any(not s.is_finished and s not in sched.running for s in fg):
            assert bg not in sched.running, "a batch line took a seat an interactive one needed"

    sim.run(on_step=check)
    assert all(len(s.output_token_ids) == 3 for s in [*fg, bg])


def test_batch_is_preempted_first_when_blocks_run_short(model_dir):
    # 12 blocks of 8 tokens: a long batch line holds most; an interactive prompt needs them.
    sched = make_scheduler(model_dir, num_blocks=12, block_size=8, max_num_batched_tokens=128)
    sim = _Sim(sched)
    bg = add(sim, list(range(5, 69)), batch=True, max_tokens=20)  # 8 blocks of prompt
    while bg.num_computed_tokens < 64:  # in chunks of max_batch_step_tokens
        sim.step()
    assert bg in sched.running
    fg = add(sim, list(range(100, 140)), batch=False, max_tokens=2)  # 5 blocks
    out = sim.step()
    assert fg in out.seqs and bg in out.preempted and bg in sched.waiting
    sim.run()
    assert len(bg.output_token_ids) == 20 and len(fg.output_token_ids) == 2
    sched.block_manager.check_all_free()


def test_batch_adapter_slot_goes_to_an_interactive_adapter(model_dir):
    sched = make_scheduler(model_dir, num_blocks=256, max_loras=2, max_num_seqs=8)
    sim = _Sim(sched)
    add(sim, [5, 6, 7], batch=True, max_tokens=30, adapter=lora(1))
    add(sim, [5, 6, 8], batch=True, max_tokens=30, adapter=lora(1))
    shared = add(sim, [5, 6, 9], batch=True, max_tokens=30, adapter=lora(2))
    fg2 = add(sim, [9, 9], batch=False, max_tokens=30, adapter=lora(2))
    sim.step()  # fg2's prompt: a step of its own
    sim.step()
    assert sched.running_adapters() == {1, 2}
    fg3 = add(sim, [8, 8], batch=False, max_tokens=2, adapter=lora(3))
    out = sim.step()
    # Adapter 1 is used by batch lines only: its two lines give its slot up. Adapter 2 stays
    # (an interactive request runs on it), and so does the batch line sharing it.
    assert fg3 in sched.running and {s.adapter_id for s in out.preempted} == {1}
    assert shared in sched.running and fg2 in sched.running
    assert sched.running_adapters() == {2, 3}


def test_interactive_never_preempted_for_batch(model_dir):
    sched = make_scheduler(model_dir, num_blocks=10, block_size=8, max_num_seqs=4)
    sim = _Sim(sched)
    fg = [add(sim, list(range(5 + 20 * i, 25 + 20 * i)), batch=False, max_tokens=30)
          for i in range(3)]  # fmt: skip
    bg = add(sim, list(range(300, 320)), batch=True, max_tokens=5)
    preempted_fg = []

    def check(out, _outputs, _running):
        preempted_fg.extend(s for s in out.preempted if s.priority == PRIORITY_INTERACTIVE)
        if bg in sched.running:
            # Only admitted once no interactive request waits.
            assert not any(s in sched.waiting for s in fg)

    sim.run(on_step=check)
    # Interactive requests only ever yield to each other (the KV shortage among themselves).
    assert all(len(s.output_token_ids) == 30 for s in fg) and len(bg.output_token_ids) == 5
    assert all(s in fg for s in preempted_fg)


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_outputs_equal_without_classes(model_dir, policy):
    """The class changes when work runs, never what it computes."""
    prompts = random_prompts(7, 16, 2, 40)

    def run(classes: bool) -> list[list[int]]:
        sched = make_scheduler(model_dir, num_blocks=24, max_num_seqs=5,
                               max_num_batched_tokens=48, scheduling_policy=policy)  # fmt: skip
        sim = _Sim(sched)
        for i, p in enumerate(prompts):
            add(sim, p, batch=classes and i % 2 == 0, max_tokens=3 + i % 5,
                adapter=lora(1 + i % 3), tenant=f"t{i % 3}")  # fmt: skip
        sim.run()
        sched.block_manager.check_all_free()
        return [s.output_token_ids for s in sim.seqs]

    assert run(True) == run(False)


def test_batch_lines_share_by_vtc_among_tenants(model_dir):
    """Two tenants' batches on idle capacity: admission alternates by service received, so a
    tenant with a huge batch does not starve another's small one."""
    sched = make_scheduler(model_dir, num_blocks=512, max_num_seqs=2, scheduling_policy="vtc")
    sim = _Sim(sched)
    big = [add(sim, [5 + i, 6, 7, 8], batch=True, max_tokens=4, tenant="big") for i in range(20)]
    small = [add(sim, [9 + i, 6, 7], batch=True, max_tokens=4, tenant="small") for i in range(3)]
    order: list[Sequence] = []

    def check(out, _outputs, running):
        order.extend(s for s in sched.running if s not in running and s not in order)

    sim.run(on_step=check)
    # The small tenant's three lines all start among the first eight admissions.
    first = order[:8]
    assert all(s in first for s in small), [s.tenant for s in order]
    assert all(len(s.output_token_ids) == 4 for s in big + small)


def test_decode_growth_preempts_the_older_batch_line_not_a_newer_interactive(model_dir):
    # FCFS alone would preempt the latest arrival (an interactive request): the class first.
    sched = make_scheduler(model_dir, num_blocks=6, block_size=8, scheduling_policy="fcfs")
    sim = _Sim(sched)
    bg = add(sim, list(range(5, 20)), batch=True, max_tokens=20)
    fg = [add(sim, list(range(30 + 20 * i, 45 + 20 * i)), batch=False, max_tokens=20)
          for i in range(2)]  # fmt: skip
    victims: list[Sequence] = []
    sim.run(on_step=lambda out, *_: victims.extend(out.preempted))
    assert victims and victims[0] is bg
    assert all(len(s.output_token_ids) == 20 for s in [bg, *fg])


def test_the_class_crosses_the_engine_process_pipe():
    from loraplex.engine.core import AddRequest
    from loraplex.engine.process.engine_process import _command, _encode_command

    sent = AddRequest("r", [1, 2], SamplingParams(max_tokens=2), None, "t", 1.0, PRIORITY_BATCH)
    assert _command(_encode_command(sent)).priority == PRIORITY_BATCH


def test_a_step_with_an_interactive_prompt_carries_no_batch_tokens(model_dir):
    sched = make_scheduler(model_dir, num_blocks=256, max_num_seqs=16)
    sim = _Sim(sched)
    batch = [add(sim, p, batch=True, max_tokens=40) for p in random_prompts(3, 6, 4, 10)]
    sim.step()
    assert sim.step().seqs  # the batch decodes
    fg = add(sim, list(range(5, 40)), batch=False, max_tokens=3)
    out = sim.step()
    assert out.seqs == [fg]  # its first token comes from a step as short as alone
    out = sim.step()
    assert set(out.seqs) == {fg, *batch}  # decodes share steps again


def test_batch_work_per_step_stays_within_max_batch_step_tokens(model_dir):
    """A step carrying batch work is what a newly arrived request waits for: the batch class
    takes at most `max_batch_step_tokens` of any step (prompts chunked, decodes oldest first),
    interactive work beside it as much as the budget allows; every line still finishes."""
    sched = make_scheduler(model_dir, num_blocks=256, max_num_seqs=16, max_batch_step_tokens=12)
    sim = _Sim(sched)
    batch = [add(sim, p, batch=True, max_tokens=4) for p in random_prompts(5, 10, 20, 30)]
    fg = None
    steps, first = 0, []

    def check(out, _outputs, _running):
        nonlocal fg, steps
        steps += 1
        low = sum(n for s, n in zip(out.seqs, out.num_new_tokens, strict=True) if s.priority)
        assert low <= 12
        if fg in out.seqs and not first:
            first.append(out.num_new_tokens[out.seqs.index(fg)])
        if steps == 3:
            fg = add(sim, list(range(5, 45)), batch=False, max_tokens=3)

    sim.run(on_step=check)
    assert first == [40]  # its whole prompt in one step, at once
    assert len(fg.output_token_ids) == 3 and all(len(s.output_token_ids) == 4 for s in batch)
    sched.block_manager.check_all_free()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cap=st.integers(1, 40),
    plan=st.lists(  # (arrives at step, batch?, prompt length, max tokens)
        st.tuples(st.integers(0, 12), st.booleans(), st.integers(1, 50), st.integers(1, 6)),
        min_size=1,
        max_size=14,
    ),
    blocks=st.integers(16, 80),
)
def test_drawn_mixes_keep_the_batch_step_cap(model_dir, cap, plan, blocks):
    """Whatever arrives when: no step gives the batch class more than its cap, a step that
    computes an interactive prompt carries no batch tokens, every request finishes and every
    block comes back."""
    sched = make_scheduler(model_dir, num_blocks=blocks, max_num_seqs=6,
                           max_num_batched_tokens=48, max_batch_step_tokens=cap)  # fmt: skip
    sim = _Sim(sched)
    pending = sorted(enumerate(plan), key=lambda x: x[1][0])
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, batch, n, m) = pending.pop(0)
            add(sim, [5 + (i * 7 + k) % 390 for k in range(n)], batch=batch, max_tokens=m,
                tenant=f"t{i % 2}")  # fmt: skip
        out = sim.step()
        rows = list(zip(out.seqs, out.num_new_tokens, strict=True))
        assert sum(n for s, n in rows if s.priority == PRIORITY_BATCH) <= cap
        if any(s.priority == PRIORITY_INTERACTIVE and s.num_computed_tokens - n
               < s.num_prompt_tokens for s, n in rows):  # fmt: skip
            assert all(s.priority == PRIORITY_INTERACTIVE for s, _ in rows)
        step += 1
        assert step < 3000, "no progress"
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in sim.seqs)
    sched.block_manager.check_all_free()
