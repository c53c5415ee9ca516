"""Scoring k > 1 proposed tokens per request in one step: greedy output unchanged whatever is
proposed, rejected tokens' KV slots returned, stops inside an accepted run honoured."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.sampling.speculative import NgramProposer, SpecPlanner, accept_prefix

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Repetitive prompts: prompt lookup finds continuations in them.
PROMPTS = [[1] + [5, 6, 7, 8, 9] * 6, [1] + [40, 41, 42] * 8 + [43], [1, 100, 200, 300, 400]]


class Oracle:
    """Proposes what the model will say (from a reference run), optionally spoiled."""

    def __init__(self, prompts, outputs, spoil_every: int = 0):
        self.by_prompt = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.spoil_every = spoil_every

    def propose(self, tokens, k):
        for prompt, out in self.by_prompt.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                guess = list(out[done : done + k])
                if self.spoil_every and guess:
                    guess[-1] = (guess[-1] + 1) % 512
                return guess
        return []


def test_accept_prefix_and_prompt_lookup():
    assert accept_prefix([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_prefix([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accept_prefix([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accept_prefix([], [5]) == [5]
    lookup = NgramProposer(k=3, min_n=2, max_n=3)
    # The latest earlier occurrence of the last 3 tokens (7 8 9) was followed by 1 2 3.
    assert lookup.propose([7, 8, 9, 4, 4, 7, 8, 9, 1, 2, 3, 5, 7, 8, 9]) == [1, 2, 3]
    assert lookup.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert lookup.propose([7, 8, 9, 4, 7, 8], k=1) == [9]  # falls back to 2-grams


@pytest.fixture(scope="module")
def setup(tiny_models, tiny_adapters):
    model = str(tiny_models["llama"])
    name, path = next(iter(tiny_adapters["llama"].items()))
    lora = LoRARequest(name, 1, str(path))
    plain = LLM(model, dtype="float32", max_lora_rank=8)
    loras = [None, lora, lora]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, loras)]
    return model, loras, want


def run(llm, loras, params=GREEDY):
    engine = llm.engine
    steps = 0
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    for rid, p, lora in zip(ids, PROMPTS, loras, strict=True):
        engine.add_request(rid, p, params, lora)
    done = {}
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    engine.block_manager.check_all_free()
    return [done[r] for r in ids], steps


def test_prompt_lookup_keeps_greedy_output_and_saves_steps(setup):
    model, loras, want = setup
    llm = LLM(model, dtype="float32", max_lora_rank=8, num_speculative_tokens=4)
    outs, steps = run(llm, loras)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_stats
    proposed, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert proposed > 0 and 0 <= accepted <= proposed


@pytest.mark.parametrize("spoil", [0, 1])
def test_any_proposals_leave_greedy_output_unchanged(setup, spoil):
    model, loras, want = setup
    llm = LLM(model, dtype="float32", max_lora_rank=8, num_speculative_tokens=3)
    llm.engine.proposer = Oracle(PROMPTS, want, spoil_every=spoil)
    llm.engine.spec_planner = None  # every proposal scored: the counts below are exact
    outs, steps = run(llm, loras)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_stats
    proposed, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    if spoil:  # the last of every 3 proposals is wrong: at most 2 of 3 land
        assert 0 < accepted <= proposed * 2 // 3
    else:  # every proposal lands: 4 tokens a step (40 tokens: the prefill step + 10 more)
        assert accepted == proposed and steps <= 12


def test_rejected_slots_are_returned_under_kv_pressure(setup):
    model, loras, want = setup
    # 8 blocks of 16 tokens for 3 requests of up to 72 tokens: preemption happens.
    llm = LLM(
        model,
        dtype="float32",
        max_lora_rank=8,
        num_speculative_tokens=4,
        num_kv_blocks=8,
        max_model_len=96,
    )
    llm.engine.proposer = Oracle(PROMPTS, want, spoil_every=1)
    outs, _ = run(llm, loras)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want


def test_a_stop_inside_accepted_tokens_ends_the_output_there(setup):
    model, loras, want = setup
    llm = LLM(model, dtype="float32", max_lora_rank=8, num_speculative_tokens=4)
    llm.engine.proposer = Oracle(PROMPTS, want)
    stop_at = want[0][9]
    first = want[0].index(stop_at)
    params = dataclasses.replace(GREEDY, stop_token_ids=[stop_at], logprobs=1)
    outs, _ = run(llm, [None] * 3, params)
    assert outs[0].token_ids == want[0][: first + 1]
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == stop_at
    assert len(outs[0].logprobs) == len(outs[0].token_ids)
    # max_tokens is never overshot by a run of accepted proposals.
    short = dataclasses.replace(GREEDY, max_tokens=7)
    outs, _ = run(llm, loras, short)
    assert all(len(o.token_ids) == 7 for o in outs)


def test_speculation_stops_for_a_request_whose_proposals_do_not_land(setup):
    model, loras, want = setup
    llm = LLM(model, dtype="float32", max_lora_rank=8, num_speculative_tokens=4)
    good, bad = Oracle(PROMPTS[:1], want[:1]), Oracle(PROMPTS[1:], want[1:])

    class Mixed:  # right for the first request, always wrong for the others
        def propose(self, tokens, k):
            return good.propose(tokens, k) or [(t + 1) % 512 for t in bad.propose(tokens, k)]

    llm.engine.proposer = Mixed()
    llm.engine.spec_planner = None  # every proposal scored: the counts below are exact
    outs, _ = run(llm, loras)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_stats
    # The first request's proposals all land; each of the others pays for 32 proposals (8
    # drafts of 4, none accepted) and is then decoded without proposals.
    assert stats.num_accepted_tokens > 30
    assert stats.num_draft_tokens - stats.num_accepted_tokens == 2 * 32
    assert stats.accepted_per_pos[0] == stats.num_drafts - 2 * 8


def test_planner_scores_what_pays_for_its_rows():
    planner = SpecPlanner(min_steps=8)
    drafts = {1: [7, 8, 9, 10], 2: [7, 8, 9, 10], 3: []}
    for seq_no, accepted in ((1, 4), (1, 4), (1, 4), (2, 0), (2, 0), (2, 0)):
        planner.observe_draft(seq_no, 4, accepted)
    assert planner.plan(drafts) == {1: 4, 2: 4, 3: 0}  # no step times yet: score everything
    # Memory-bound steps (rows nearly free): every proposal pays.
    for rows in range(3, 14):
        planner.observe_step(rows, 0.050 + 0.000001 * rows)
    assert planner.plan(drafts) == {1: 4, 2: 4, 3: 0}
    # 10 ms a row on top of 50 ms (the demo model on one CPU core: about 68 + 7 per row):
    # request 1 (every proposal landed so far) keeps its draft, request 2 (none landed:
    # p = 1/5) keeps none, request 3 had nothing to propose.
    for rows in range(3, 67):
        planner.observe_step(rows, 0.050 + 0.010 * rows)
    assert planner.plan(drafts) == {1: 4, 2: 0, 3: 0}
    a, b = planner.cost()
    assert a == pytest.approx(0.050) and b == pytest.approx(0.010)
    # Steps that cost rows only (no fixed part): a proposal (< 1 token) never beats a row.
    for rows in range(3, 67):
        planner.observe_step(rows, 0.010 * rows)
    assert planner.plan(drafts) == {1: 0, 2: 0, 3: 0}
    # Finished requests are forgotten.
    planner.plan({3: []})
    assert set(planner.counts) == set()
