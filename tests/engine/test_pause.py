"""Pausing a request (its stream's reader fell behind): no steps, no batch slot, its KV kept;
resumed, it goes on where it stopped with the same tokens; when blocks run short, a paused
request gives its blocks back before any running one is preempted."""

from __future__ import annotations

from tests.engine.test_scheduler import _Sim, make_scheduler, model_dir, outputs_of

__all__ = ["model_dir"]  # the fixture, shared with the scheduler's tests


def _reference(model_dir, prompts, max_tokens):
    sim = _Sim(make_scheduler(model_dir))
    for p in prompts:
        sim.add(p, max_tokens=max_tokens)
    sim.run()
    return outputs_of(sim)


def test_a_paused_sequence_gets_no_steps_and_frees_its_seat_but_keeps_its_kv(model_dir):
    prompts = [[7] * 12, [8] * 12, [9] * 12]
    sched = make_scheduler(model_dir, max_num_seqs=2)
    sim = _Sim(sched)
    a, b, c = (sim.add(p, max_tokens=8) for p in prompts)
    sim.step()
    sim.step()
    assert sched.running == [a, b] and c in sched.waiting
    made, blocks = len(a.output_token_ids), list(a.block_table)
    sched.pause(a)
    for _ in range(3):
        out = sim.step()
        assert a not in out.seqs
    assert c in sched.running  # a's seat went to the waiting request
    assert len(a.output_token_ids) == made and a.block_table == blocks
    sched.resume(a)
    sim.run()
    assert a.num_cached_tokens == 0  # never recomputed: it went on with the blocks it kept
    assert outputs_of(sim) == _reference(model_dir, prompts, 8)
    sched.block_manager.check_all_free()


def test_paused_blocks_are_taken_before_a_running_sequence_is_preempted(model_dir):
    prompts = [[7] * 16, [8] * 16]
    sched = make_scheduler(model_dir, num_blocks=4, block_size=8, prefix_caching=False)
    sim = _Sim(sched)
    a = sim.add(prompts[0], max_tokens=6)
    sim.step()
    sched.pause(a)
    assert a.block_table  # kept while nobody needs them
    b = sim.add(prompts[1], max_tokens=6)
    for _ in range(50):
        sim.step()
        if b.is_finished:
            break
    assert b.is_finished, "the paused request's blocks starved a running one"
    assert not a.block_table and a.num_computed_tokens == 0  # given back for b
    sched.resume(a)
    sim.run()
    assert outputs_of(sim) == _reference(model_dir, prompts, 6)
    sched.block_manager.check_all_free()


def test_aborting_a_paused_sequence_frees_its_blocks(model_dir):
    sched = make_scheduler(model_dir)
    sim = _Sim(sched)
    a = sim.add([7] * 12, max_tokens=8)
    sim.step()
    sched.pause(a)
    sched.finish(a, "abort")
    assert not sched.has_unfinished() and not sched.paused
    sched.block_manager.check_all_free()
