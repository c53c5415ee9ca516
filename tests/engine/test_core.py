"""The engine core loop both server modes run (engine/core.py), driven directly: commands in,
results and stats snapshots out, stop and failure behaviour."""

from __future__ import annotations

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.core import AbortRequest, AddRequest, CommandSource, EngineCore, Stop
from loraplex.engine.outputs import RequestOutput


class Script(CommandSource):
    """Hands out one batch of commands per loop turn, in order."""

    def __init__(self, batches: list[list]):
        self.batches = batches

    def wait(self, timeout: float) -> bool:
        return bool(self.batches)

    def drain(self) -> list:
        return self.batches.pop(0) if self.batches else []


@pytest.fixture
def engine(tiny_models):
    return LLMEngine(EngineConfig(str(tiny_models["llama"]), dtype="float32"))


def _add(rid: str, tokens: int, **kw) -> AddRequest:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **kw)
    return AddRequest(rid, [5, 17, 99, 3], params, None, "t", 1.0)


def test_run_streams_results_then_stops_aborting_what_is_left(engine):
    """Two requests, one bad (its error goes to it alone), one aborted mid-way; the stop
    hands out the unfinished one's last output as aborted and leaves the engine empty."""
    bad = AddRequest("bad", [], SamplingParams(max_tokens=2), None, "t", 1.0)  # empty prompt
    script = Script([[_add("a", 4), _add("b", 50), _add("c", 50), bad], [], [],
                     [AbortRequest("b")], [], [Stop()]])  # fmt: skip
    got: dict[str, list] = {}
    snapshots = []

    def sink(results, stats):
        for rid, item in results:
            got.setdefault(rid, []).append(item)
        if stats is not None:
            snapshots.append(stats)

    EngineCore(engine).run(script, sink)
    (err,) = got["bad"]
    assert isinstance(err, ValueError)
    a = [o for o in got["a"] if isinstance(o, RequestOutput)]
    assert a[-1].finished and len(a[-1].outputs[0].token_ids) == 4
    assert got["b"][-1].finished and got["b"][-1].outputs[0].finish_reason == "abort"
    assert got["c"][-1].finished and got["c"][-1].outputs[0].finish_reason == "abort"
    assert 0 < len(got["c"][-1].outputs[0].token_ids) < 50
    assert not engine.has_unfinished() and not snapshots  # no stats_every_s: none sent
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_snapshots_follow_the_queue_not_only_the_clock(engine):
    """With a long period, a snapshot still goes out as soon as the request counts change:
    the add, the step that finishes the request, then nothing more while idle."""
    script = Script([[_add("a", 3)], [], [], [], [], [], [Stop()]])
    snapshots = []
    core = EngineCore(engine, stats_every_s=3600)
    core.run(script, lambda results, stats: stats is not None and snapshots.append(stats))
    counts = [(s.running, s.waiting) for s in snapshots]
    assert counts[0] == (1, 0)  # the first step already runs the request
    assert counts[-1] == (0, 0)
    assert len(counts) == len(set(counts))  # one per change


def test_an_engine_error_propagates_with_requests_left_for_the_caller(engine, monkeypatch):
    """A failing step raises out of run without aborting: the server mode fails its callers
    first (EngineDeadError), then calls abort_all to free the engine."""
    script = Script([[_add("a", 20)], [], [], [Stop()]])
    calls = []
    real = engine.step

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine, "step", step)
    core = EngineCore(engine)
    with pytest.raises(RuntimeError, match="boom"):
        core.run(script, lambda results, stats: None)
    assert engine.has_unfinished()
    aborted = []
    core.abort_all(lambda results, stats: aborted.extend(results))
    assert [rid for rid, _ in aborted] == ["a"] and not engine.has_unfinished()


def _collect(engine, script, **kw) -> tuple[dict[str, list[RequestOutput]], list[int]]:
    got: dict[str, list[RequestOutput]] = {}
    sizes: list[int] = []  # results per sink call

    def sink(results, stats):
        if results:
            sizes.append(len(results))
        for rid, item in results:
            got.setdefault(rid, []).append(item)

    EngineCore(engine, **kw).run(script, sink)
    return got, sizes


def _turns(first: list, n: int, at: dict[int, list] | None = None) -> list[list]:
    return [first] + [(at or {}).get(i, []) for i in range(1, n)] + [[Stop()]]


def test_coalesced_outputs_add_up_to_the_same_generation(engine, tiny_models):
    """coalesce_s holds a running request's outputs back and hands them out together: the
    first output and the finish go out at once, what was held goes with them, each step's
    output still on its own (a stream's chunk per token); the deltas (text and ids) of what
    the sink gets are those of stepping one by one, an abort included."""
    first = [_add("a", 30), _add("b", 12, stop=["zz"]), _add("c", 40)]
    script = _turns(first, 60, {8: [AbortRequest("c")]})
    plain, plain_calls = _collect(engine, Script([list(t) for t in script]))
    engine2 = LLMEngine(EngineConfig(str(tiny_models["llama"]), dtype="float32"))
    merged, merged_calls = _collect(engine2, Script(script), coalesce_s=3600)
    assert len(merged_calls) < len(plain_calls) / 3
    for rid in ("a", "b", "c"):
        p, m = plain[rid][-1], merged[rid][-1]
        assert m.finished
        assert merged[rid][0].outputs[0].token_ids == plain[rid][0].outputs[0].token_ids
        if rid != "c":  # the abort lands at the same turn; what was generated by then may
            assert m.outputs[0].token_ids == p.outputs[0].token_ids  # differ by a step
            assert m.outputs[0].text == p.outputs[0].text
            # One output per step, as without coalescing: the same deltas, in order.
            assert [(o.delta_token_ids, o.delta_text) for o in merged[rid]] == [
                (o.delta_token_ids, o.delta_text) for o in plain[rid]
            ]
        assert sum((o.delta_token_ids for o in merged[rid]), []) == m.outputs[0].token_ids
        assert "".join(o.delta_text for o in merged[rid]) == m.outputs[0].text
    assert merged["c"][-1].outputs[0].finish_reason == "abort"


def test_a_stalled_step_hands_out_what_is_held(engine, monkeypatch):
    """A step that advances nothing (all requests waiting on an adapter, say) flushes the
    held outputs rather than keeping them until the next token."""
    real, calls = engine.step, []

    def step():
        calls.append(1)
        return [] if len(calls) == 5 else real()

    monkeypatch.setattr(engine, "step", step)
    got: list[tuple[int, int]] = []  # (step count, tokens so far) at each hand-out
    sink = lambda results, stats: got.extend(  # noqa: E731
        (len(calls), len(out.outputs[0].token_ids)) for _, out in results
    )
    EngineCore(engine, coalesce_s=3600).run(Script(_turns([_add("a", 20)], 30)), sink)
    # Handed out at step 1 (the first token), step 5 (tokens 2-4, one output each), the end.
    assert got[:4] == [(1, 1), (5, 2), (5, 3), (5, 4)]
    assert [n for _, n in got] == list(range(1, 21)) and got[4][0] == got[-1][0] > 5
