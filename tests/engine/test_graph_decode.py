"""Graph-ready decode on the CPU: the forward replayed from persistent buffers (what a CUDA
graph captures) equals the ordinary step, while batch composition, adapters, slot contents
and block tables change from step to step (hypothesis draws the runs)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.step.graph_runner import buckets
from tests.utils.outputs import assert_same_outputs

ADAPTERS = ["qv4", "attn8", "mlp16", "all2"]


@pytest.fixture(scope="module")
def engines(tiny_models):
    """(eager, graph-ready) engines on one model; two slots for four adapters, small blocks."""
    args = dict(dtype="float32", max_loras=2, max_lora_rank=16, block_size=8, max_num_seqs=8,
                max_model_len=96)  # fmt: skip
    base = str(tiny_models["llama"])
    return LLM(base, **args), LLM(base, enforce_eager=False, **args)


@st.composite
def runs(draw):
    n = draw(st.integers(1, 8))
    prompts = [draw(st.lists(st.integers(5, 500), min_size=1, max_size=12)) for _ in range(n)]
    adapters = [draw(st.sampled_from([None, *ADAPTERS])) for _ in range(n)]
    lengths = [draw(st.integers(1, 14)) for _ in range(n)]
    return prompts, adapters, lengths


SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=SLOW)
@given(run=runs())
def test_graph_ready_decode_equals_the_ordinary_step(run, engines, tiny_adapters):
    prompts, adapters, lengths = run
    folders = tiny_adapters["llama"]
    loras = [None if a is None else LoRARequest(a, ADAPTERS.index(a) + 1, str(folders[a]))
             for a in adapters]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in lengths]  # fmt: skip
    eager, graphs = engines
    before = graphs.engine.runner.graphs.replays
    want = eager.generate(prompts, params, loras)
    got = graphs.generate(prompts, params, loras)
    assert_same_outputs(got, want, atol=1e-5, rtol=1e-5)
    if max(lengths) > 1:
        assert graphs.engine.runner.graphs.replays > before  # decode steps took the buffers


def test_buckets_and_what_is_not_captured(tiny_models):
    assert buckets(1) == [1] and buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_lora_rank=8)
    assert llm.engine.runner.graphs is None  # the CPU runs its steps as they come by default


def test_forwards_made_up_front_serve_the_steps_that_follow(engines, tiny_adapters):
    """What a CUDA engine does at start (`DecodeGraphs.capture_all`): every bucket's forward
    made from the buffers' padding contents, with and without LoRA, then reused as rows,
    adapters and block tables arrive (on the CPU the same forwards, uncaptured)."""
    eager, graphs = engines
    runner = graphs.engine.runner.graphs
    assert runner.capture_all(lora=True) >= 0
    made = {(b, lora, False) for b in runner.buckets for lora in (False, True)}
    assert made <= set(runner.graphs)
    forwards = dict(runner.graphs)
    folders = tiny_adapters["llama"]
    loras = [None, LoRARequest("qv4", 1, str(folders["qv4"])), None,
             LoRARequest("mlp16", 3, str(folders["mlp16"]))]  # fmt: skip
    prompts = [[5, 9, 13], [7, 8], [100, 200, 300, 400], [42]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    before = runner.replays
    got = graphs.generate(prompts, params, loras)
    assert_same_outputs(got, eager.generate(prompts, params, loras), atol=1e-5, rtol=1e-5)
    assert runner.replays > before
    assert all(runner.graphs[k] is forwards[k] for k in made)  # none made again
