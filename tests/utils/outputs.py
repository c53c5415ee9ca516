"""Comparing two runs' RequestOutputs: the same tokens, and each step's top log-probabilities
for the same token ids within a tolerance."""

from __future__ import annotations

import torch


def assert_same_outputs(got, want, atol: float, rtol: float = 0.0) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            got_lp, want_lp = torch.tensor(list(lg.values())), torch.tensor(list(lw.values()))
            torch.testing.assert_close(got_lp, want_lp, rtol=rtol, atol=atol)
