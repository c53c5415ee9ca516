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
