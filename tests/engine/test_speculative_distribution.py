"""Speculative decoding keeps the sampled distribution: many seeded sampled generations on a
tiny random model with an 8-token vocabulary, speculation on (a proposer that mixes the
likeliest and the unlikeliest tokens) and off, compared by chi-square tests with the exact
distribution of the transformers reference. The same tests reject two planted bugs.

Two statistics, each with cells of expected count >= 5 (smaller ones pooled):

- joint: the pair (t2, t3) of generated tokens: the first tokens speculation produces (t1
  comes from the prefill step), against P(t2, t3) = sum_t1 P(t1) P(t2|t1) P(t3|t1,t2).
- rank: every generated token's rank under its own exact conditional distribution, counted
  per position, against the sum of those conditionals (a sum of differently distributed
  categoricals: Pearson's statistic is then at most chi-square, so the test is conservative).

scipy is not installed: the chi-square tail is the regularised upper incomplete gamma,
`torch.special.gammaincc(dof / 2, x / 2)`.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.engine import llm_engine as llm_engine_module
from testkit.factories import make_tiny_model

V = 8  # vocabulary
L = 5  # generated tokens per request
K = 3  # proposals per step
N = 1200  # requests per run (a planted bug is caught with far fewer: N_BUG)
N_BUG = 300
PROMPT = [1, 5, 6, 7, 5, 6]
ALPHA = 1e-3  # seeded: a pass is deterministic; a correct sampler fails 1 seed in 1000
TEMPERATURE_1 = SamplingParams(temperature=1.0, max_tokens=L, ignore_eos=True)
TRUNCATED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=L, ignore_eos=True)


def truncate(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The sampler's distribution for `p` (temperature, then top_k, then top_p over the
    top_k survivors renormalised): [..., V] logits -> [..., V] probabilities."""
    x = logits / p.temperature
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    k = p.top_k if 0 < p.top_k < V else V
    xs[..., k:] = -np.inf
    probs = np.exp(xs - xs[..., :1])
    probs /= probs.sum(-1, keepdims=True)
    before = np.cumsum(probs, -1) - probs
    if p.top_p < 1.0:
        probs[before >= p.top_p] = 0.0
    probs /= probs.sum(-1, keepdims=True)
    out = np.empty_like(probs)
    np.put_along_axis(out, order, probs, axis=-1)
    return out


class Tree:
    """Exact next-token distributions after PROMPT + every generated prefix shorter than L,
    from one batched forward of the transformers model over all V^(L-1) continuations."""

    def __init__(self, model_dir, params: SamplingParams):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tails = list(itertools.product(range(V), repeat=L - 1))
        ids = torch.tensor([PROMPT + list(t) for t in tails])  # [V^(L-1), len(PROMPT) + L - 1]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(PROMPT) - 1 :].double().numpy()
        probs = truncate(logits, params)  # [V^(L-1), L, V]
        self.p: dict[tuple[int, ...], np.ndarray] = {}
        for tail, row in zip(tails, probs, strict=True):
            for m in range(L):
                self.p.setdefault(tail[:m], row[m])

    def pair(self) -> np.ndarray:
        """P(t2, t3): [V, V]."""
        out = np.zeros((V, V))
        for t1 in range(V):
            p1 = self.p[()][t1]
            out += p1 * self.p[(t1,)][:, None] * np.stack([self.p[(t1, a)] for a in range(V)])
        return out


class MixedProposer:
    """Proposes, after each context, the exact distribution's likeliest token or (one time in
    three, by a hash of the context) its least likely: both acceptance paths get exercised."""

    def __init__(self, tree: Tree):
        self.tree = tree

    def propose(self, tokens: list[int], k: int) -> list[int]:
        gen = tuple(tokens[len(PROMPT) :])
        out: list[int] = []
        for j in range(k):
            p = self.tree.p[gen + tuple(out)]
            unlikely = (sum(gen) + len(gen) + j) % 3 == 0
            out.append(int(np.argmin(np.where(p > 0, p, 2.0)) if unlikely else np.argmax(p)))
        return out


def chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    """Pearson's statistic over cells with expected >= 5 plus one pooled cell of the rest
    (dropped when its expectation is under 5 too); returns (statistic, dof, p-value)."""
    observed, expected = observed.ravel().astype(float), expected.ravel()
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if expected[~big].sum() >= 5:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    else:  # cells the model (almost) never produces: their observations still count
        exp[-1] += expected[~big].sum()
        obs[-1] += observed[~big].sum()
    o, e = np.array(obs), np.array(exp)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(o) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    return stat, dof, p


def generate(model_dir, tree: Tree, params: SamplingParams, speculate: bool, n: int = N):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=256, num_speculative_tokens=K)
    if speculate:
        llm.engine.proposer = MixedProposer(tree)
        llm.engine.spec_planner = None  # keep every proposal: timing must not steer the run
    else:
        llm.engine.proposer = None
    outs = llm.generate(
        [PROMPT] * n, [dataclasses.replace(params, seed=1000 + i) for i in range(n)]
    )
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [n, L]
    assert tokens.shape == (n, L)
    return tokens, llm.engine.spec_stats


def statistics(tree: Tree, tokens: np.ndarray) -> dict[str, tuple[float, int, float]]:
    pair = np.zeros((V, V))
    np.add.at(pair, (tokens[:, 1], tokens[:, 2]), 1)
    rank_obs, rank_exp = np.zeros((L, V)), np.zeros((L, V))
    for row in tokens:
        for t in range(L):
            p = tree.p[tuple(row[:t])]
            order = np.argsort(-p, kind="stable")  # rank 0: the likeliest token
            rank_obs[t, int(np.flatnonzero(order == row[t])[0])] += 1
            rank_exp[t] += p[order]
    return {
        "joint": chi_square(pair, len(tokens) * tree.pair()),
        "rank": chi_square(rank_obs, rank_exp),
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Weights 0.2 (not 0.08): peaked enough that likely and unlikely proposals differ a lot.
    path = tmp_path_factory.mktemp("vocab8") / "llama"
    return make_tiny_model("llama", path, vocab_size=V, seed=3, initializer_range=0.2)


@pytest.mark.parametrize("params", [TEMPERATURE_1, TRUNCATED], ids=["t1", "topk-topp"])
def test_speculation_keeps_the_sampled_distribution(model_dir, params):
    tree = Tree(model_dir, params)
    plain, _ = generate(model_dir, tree, params, speculate=False)
    spec, counts = generate(model_dir, tree, params, speculate=True)
    # Both paths ran often: most drafts had a rejection, many accepted 1 and 2 tokens.
    assert counts.num_drafts > N and counts.num_accepted_tokens < counts.num_draft_tokens / 2
    assert min(counts.accepted_per_pos[:2]) > N / 20
    for name, tokens in (("plain", plain), ("speculative", spec)):
        for stat_name, (stat, dof, p) in statistics(tree, tokens).items():
            assert p > ALPHA, f"{name} {stat_name}: chi2 {stat:.1f} on {dof} dof, p={p:.2e}"


def _accept_all(proposed, drawn):
    return proposed + [drawn[len(proposed)]]  # no rejection step


def _bonus_from_last_row(proposed, drawn):
    a = 0
    while a < len(proposed) and drawn[a] == proposed[a]:
        a += 1
    return proposed[:a] + [drawn[-1]]  # after a rejection, a draw from the wrong context


@pytest.mark.parametrize("bug", [_accept_all, _bonus_from_last_row])
def test_the_statistics_reject_a_broken_acceptance_rule(model_dir, bug, monkeypatch):
    tree = Tree(model_dir, TEMPERATURE_1)
    monkeypatch.setattr(llm_engine_module, "accept_prefix", bug)
    tokens, _ = generate(model_dir, tree, TEMPERATURE_1, speculate=True, n=N_BUG)
    results = statistics(tree, tokens)
    assert min(p for _, _, p in results.values()) < 1e-6, results
