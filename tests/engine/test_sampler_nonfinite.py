"""A row whose logits are not finite is named in `SamplerOutput.nonfinite`, gets no logprobs,
and takes no part in what the sampler decides for the batch (issue 62); -inf logprobs are
reported as LOGPROB_FLOOR, so no logprob is ever non-finite."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.sampling.sampler import LOGPROB_FLOOR, Sampler, make_generator
from loraplex.engine.sampling_params import SamplingParams

VOCAB = 4096  # past the top-p candidate count, so top-p may decide between two forms
RUINED = {"nan": float("nan"), "inf": float("inf"), "all -inf": float("-inf")}


def _sample(logits: torch.Tensor, params: list[SamplingParams]):
    gens = [make_generator(p.seed, "cpu") for p in params]
    rows = len(params)
    return Sampler(eos_token_ids={2}, seed=0)(logits.clone(), params, [[1]] * rows,
                                             [[]] * rows, gens)  # fmt: skip


@pytest.mark.parametrize("ruin", list(RUINED))
@pytest.mark.parametrize("kind", ["greedy", "top_p"])
def test_a_ruined_row_changes_no_other_row(ruin, kind):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    if kind == "greedy":
        params = [SamplingParams(temperature=0, logprobs=2) for _ in range(4)]
    else:  # seeded: each row's draw is its own
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=10 + i, logprobs=2)
                  for i in range(4)]  # fmt: skip
    clean = _sample(logits, params)
    ruined = logits.clone()
    ruined[1] = RUINED[ruin] if ruin == "all -inf" else ruined[1]
    ruined[1, 7] = RUINED[ruin]
    out = _sample(ruined, params)
    assert out.nonfinite == [1] and clean.nonfinite == []
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    for r in (0, 2, 3):
        assert out.token_ids[r] == clean.token_ids[r]
        assert out.logprobs[r] == clean.logprobs[r]
        assert out.top_logprobs[r] == clean.top_logprobs[r]


def test_a_ruled_out_token_is_reported_at_the_floor():
    logits = torch.randn(1, 16)
    logits[0, 3:] = float("-inf")  # a finite row: tokens 3.. have probability 0
    params = [SamplingParams(temperature=0, logprobs=16)]
    out = _sample(logits, params)
    assert out.nonfinite == []
    values = [v for _, v in out.top_logprobs[0]]
    assert all(math.isfinite(v) for v in values) and values[-1] == LOGPROB_FLOOR
