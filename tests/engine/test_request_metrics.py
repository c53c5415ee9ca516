"""RequestOutput.metrics: when each request passed each stage (vLLM's RequestMetrics names) and
how often it was preempted, in order, and carried across the engine process's pipe."""

from __future__ import annotations

import dataclasses
import time

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.process.output_deltas import OutputDecoder, OutputEncoder, StepMessage


def test_stage_times_are_in_order_and_preemptions_counted(tiny_models):
    # A pool this small preempts: the same set-up as the parity test's preemption case.
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=80, num_kv_blocks=10,
              block_size=8)  # fmt: skip
    before = time.time()
    prompts = [[5 + i] * (20 + 3 * i) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    after = time.time()
    for out in outs:
        m = out.metrics
        assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time <= after
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions > 0


def test_metrics_cross_the_pipe(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    # sent whole, as if it were the request's only output
    out = dataclasses.replace(out, delta_token_ids=list(out.outputs[0].token_ids))
    raw = StepMessage(outputs=[OutputEncoder().encode(out)]).to_json()
    back = OutputDecoder().decode(StepMessage.from_json(raw).outputs[0])
    assert back.metrics == out.metrics and back.metrics.finished_time is not None
