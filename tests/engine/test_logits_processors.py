"""The sampler's logits-processor hook: per request, batched per class, state kept per request."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.sampling import logits_processors as lp
from loraplex.engine.sampling.logits_processors import LogitsProcessor, ProcessorContext
from loraplex.engine.sampling.sampler import Sampler

PROMPTS = [[1, 17, 42, 99, 250, 7], [1, 5, 6, 7], [1, 300, 301, 302, 303]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class AllowOnly(LogitsProcessor):
    """Test processor: only the spec's tokens may be produced, in order, then the request ends."""

    batches: list[int] = []  # rows per apply_batch call, over the test

    def __init__(self, spec: dict, ctx: ProcessorContext):
        self.plan = list(spec["tokens"])
        self.seen: list[int] = []

    @classmethod
    def apply_batch(cls, logits, rows, processors) -> None:
        cls.batches.append(len(rows))
        keep = torch.full_like(logits[rows], float("-inf"))
        for j, p in enumerate(processors):
            keep[j, p.plan[len(p.seen)]] = 0.0
        logits[rows] += keep

    def accept(self, token_id: int) -> None:
        assert token_id == self.plan[len(self.seen)], "the sampler ignored the mask"
        self.seen.append(token_id)

    def is_finished(self) -> bool:
        return len(self.seen) == len(self.plan)


lp.register("test-allow-only")(AllowOnly)


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32")


def test_processors_run_once_per_class_per_step_and_other_rows_are_untouched(llm):
    free = llm.generate(PROMPTS, GREEDY)
    plans = [[11, 12, 13], [21, 22, 23, 24, 25]]
    params = [
        dataclasses.replace(GREEDY, logits_processors=[{"kind": "test-allow-only", "tokens": p}])
        for p in plans
    ]
    AllowOnly.batches.clear()
    outs = llm.generate(PROMPTS, [*params, GREEDY])
    # Both constrained rows in one call per step while both ran, then the longer alone.
    assert AllowOnly.batches == [2, 2, 2, 1, 1]
    for out, plan in zip(outs, plans, strict=False):
        assert out.outputs[0].token_ids == plan
        assert out.outputs[0].finish_reason == "stop"  # the processor said it was done
    assert outs[2].outputs[0].token_ids == free[2].outputs[0].token_ids


def test_processors_constrain_sampled_rows_too(llm):
    plan = [7, 8, 9, 10]
    p = SamplingParams(
        temperature=1.5,
        top_p=0.9,
        seed=3,
        max_tokens=10,
        logits_processors=[{"kind": "test-allow-only", "tokens": plan}],
    )
    (out,) = llm.generate([PROMPTS[0]], p)
    assert out.outputs[0].token_ids == plan


def test_logit_bias_steers_only_its_own_request(llm):
    free = llm.generate(PROMPTS, GREEDY)
    forced = (free[0].outputs[0].token_ids[0] + 1) % llm.engine.vocab_size
    biased = dataclasses.replace(GREEDY, logit_bias={forced: 100, 3: -100})
    outs = llm.generate(PROMPTS, [biased, GREEDY, biased])
    assert outs[0].outputs[0].token_ids == [forced] * 8
    assert outs[2].outputs[0].token_ids == [forced] * 8
    assert outs[1].outputs[0].token_ids == free[1].outputs[0].token_ids
    # A ban: the free run's first token never appears under a -100 bias.
    banned = free[1].outputs[0].token_ids[0]
    (out,) = llm.generate([PROMPTS[1]], dataclasses.replace(GREEDY, logit_bias={banned: -100}))
    assert banned not in out.outputs[0].token_ids


def test_logit_bias_crosses_json_with_string_keys_and_clamps():
    p = SamplingParams(logit_bias={5: 250.0, 9: -3})
    back = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))
    assert back.logit_bias == {5: 250.0, 9: -3.0}
    bias = lp.LogitBias(back.logit_bias, vocab_size=16)
    x = torch.zeros(2, 16)
    lp.apply_processors(x, [[], [bias]])
    assert x[0].abs().sum() == 0 and x[1, 5] == 100.0 and x[1, 9] == -3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias keys"),
        ({"logit_bias": {3: "high"}}, "logit_bias values"),
        ({"logits_processors": [{"tokens": [1]}]}, "logits_processors must be"),
    ],
)
def test_bad_specs_are_refused_when_params_are_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_specs_queue_nothing(llm):
    engine = llm.engine
    vocab = engine.vocab_size
    for params, message in [
        (SamplingParams(logit_bias={vocab: 1.0}), "outside this model's vocabulary"),
        (SamplingParams(logits_processors=[{"kind": "nope"}]), "unknown logits processor"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", PROMPTS[0], params)
        assert not engine.has_unfinished() and "bad" not in engine.requests


def test_sampler_hot_path_is_unchanged_without_processors():
    sampler = Sampler([0], seed=0)
    logits = torch.randn(3, 64)
    params = [SamplingParams(temperature=0)] * 3
    args = (logits, params, [[1]] * 3, [[]] * 3, [None] * 3)
    plain = sampler(*args).token_ids
    assert plain == logits.argmax(-1).tolist()
    assert sampler(*args, [[], [], []]).token_ids == plain
