"""Speculative decoding: propose k tokens per request, score them in one forward pass, keep
the prefix the model agrees with.

    step t:  tokens ... x   proposals d0 d1 .. d(k-1)
             rows computed:  x   d0   d1  ...  d(k-1)        (k + 1 rows, one pass)
             row j draws t_j from the model's distribution after d0..d(j-1)
             accept d_j while t_j == d_j; then t_a is the bonus token
             new tokens: d0 .. d(a-1), t_a       (1 to k + 1 per step)

For a deterministic proposal (n-gram lookup: q is one-hot on d_j) "draw t_j from p and accept
when it equals d_j" accepts d_j with probability p(d_j), and on a mismatch t_j is a draw from
p restricted to tokens other than d_j — exactly the rejection-sampling rule (Leviathan et al.)
with q one-hot, so sampled outputs keep the model's distribution; greedy outputs are the
non-speculative ones token for token. Each row is drawn with the request's own generator.

Requests with logits processors (grammars) are not speculated: a processor would have to judge
proposals it has not accepted yet.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


def accept_prefix(proposed: list[int], drawn: list[int]) -> list[int]:
    """The new tokens: the proposals matching the draws, then the first draw that differs
    (or the bonus draw after all k). `drawn` has len(proposed) + 1 entries."""
    assert len(drawn) == len(proposed) + 1
    a = 0
    while a < len(proposed) and drawn[a] == proposed[a]:
        a += 1
    return proposed[:a] + [drawn[a]]


@dataclass
class SpecDecodeStats:
    """Engine-wide counters, with vLLM's meanings: a draft is one request's proposals scored in
    one step; `accepted_per_pos[j]` counts drafts whose (j+1)-th proposal was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos += [0] * (num_proposed - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from `max_n` down to `min_n`) are proposed as its next tokens."""

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4):
        assert k >= 1 and 1 <= min_n <= max_n
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            # Windows of n tokens that end before the last token (so something follows).
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []


class SpecPlanner:
    """How many of its proposals each request scores this step: as many as raise the step's
    expected tokens per second.

    Every proposal costs a row of the forward pass; it yields a token only if it and all
    before it are accepted. A request's proposals are accepted with probability p (estimated
    per request: accepted / (accepted + rejections), prior 1 / 2), so its j-th proposal is
    worth p^j tokens. Step time is modelled as a + b * rows, fitted by least squares to the
    recent decode-only steps. Proposals are taken best first while each adds more tokens than
    its row costs at the step's current rate: p^j * t > b * T (T expected tokens, t the step's
    expected seconds). On a memory-bound step (a GPU, or a CPU at batch 1) b is small and all
    proposals pass; where rows cost compute, only the likely ones do. Until the fit exists
    (too few steps, or too little spread in their row counts) every proposal is scored.
    """

    def __init__(self, window: int = 64, min_steps: int = 8):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, seconds)
        self.min_steps = min_steps
        self.counts: dict[int, list[int]] = {}  # seq_no -> [accepted, rejections]

    def observe_step(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def observe_draft(self, seq_no: int, proposed: int, accepted: int) -> None:
        c = self.counts.setdefault(seq_no, [0, 0])
        c[0] += accepted
        c[1] += accepted < proposed

    def cost(self) -> tuple[float, float] | None:
        """(a, b) of step seconds = a + b * rows, or None without enough spread."""
        if len(self.steps) < self.min_steps:
            return None
        rows = np.array([r for r, _ in self.steps], dtype=np.float64)
        secs = np.array([s for _, s in self.steps], dtype=np.float64)
        if rows.max() - rows.min() < 2:
            return None
        b, a = np.polyfit(rows, secs, 1)
        return float(a), max(float(b), 0.0)

    def plan(self, drafts: dict[int, list[int]]) -> dict[int, int]:
        """seq_no -> proposals kept (a prefix of its draft), for the decodes of one step;
        `drafts` holds every decode, with [] where there is nothing to propose."""
        for seq_no in [s for s in self.counts if s not in drafts]:
            del self.counts[seq_no]  # finished or preempted
        keep = {s: len(d) for s, d in drafts.items()}
        fit = self.cost()
        if fit is None:
            return keep
        a, b = fit
        gains = []  # (worth in tokens, seq_no, j)
        for seq_no, draft in drafts.items():
            acc, rej = self.counts.get(seq_no, (0, 0))
            p = (acc + 1) / (acc + rej + 2)
            gains += [(p ** (j + 1), seq_no, j) for j in range(len(draft))]
        gains.sort(reverse=True)
        keep = dict.fromkeys(drafts, 0)
        tokens, seconds = float(len(drafts)), a + b * len(drafts)
        for g, seq_no, j in gains:
            if g * seconds <= b * tokens or keep[seq_no] != j:
                continue  # not worth its row (or one before it in the draft was dropped)
            keep[seq_no] = j + 1
            tokens, seconds = tokens + g, seconds + b
        return keep
