"""KV-aware admission: admit a request only when the KV growth expected of it fits.

Admitting by prompt size alone lets a batch of long generations outgrow the pool mid-decode;
each shortage then preempts a request and recomputes its whole context. Here a request's
expected length is its prompt plus an expected output learned from finished requests:

    expected output  = mean output of finished requests of the same (tenant, adapter), else of
                       the tenant, else of everyone; at least what it has generated so far
                       plus one block; at most its max_tokens (and the model's length limit)
    admit            when the blocks it is expected to need beyond those it will share from
                     the prefix cache, plus the blocks the running requests are still expected
                     to take, fit in the free blocks; always when nothing runs (progress), and
                     by prompt alone until some request has finished (nothing learned yet)

The scheduler keeps its admission order (FCFS or fair share) and stops at the first request
that does not fit, so a long request is never passed over for shorter ones behind it.

When the pool runs short anyway, `cheapest_victim` picks among the policy's candidates the
request whose preemption recomputes the fewest tokens.
"""

from __future__ import annotations

from collections import defaultdict

from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.sequence import Sequence


class OutputLengthEstimator:
    """Mean output length of finished requests, per (tenant, adapter), tenant and overall."""

    def __init__(self) -> None:
        self._sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])

    @staticmethod
    def _keys(seq: Sequence) -> tuple[tuple, ...]:
        return (("pair", seq.tenant, seq.adapter_id), ("tenant", seq.tenant), ("all",))

    def observe(self, seq: Sequence) -> None:
        """A request finished on its own (stop or length): learn its output length."""
        for key in self._keys(seq):
            acc = self._sums[key]
            acc[0] += len(seq.output_token_ids)
            acc[1] += 1

    def mean(self, seq: Sequence) -> float | None:
        for key in self._keys(seq):
            total, n = self._sums.get(key, (0.0, 0))
            if n:
                return total / n
        return None


class KVAdmission:
    def __init__(self, block_manager: BlockManager, max_model_len: int):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.estimator = OutputLengthEstimator()

    def expected_tokens(self, seq: Sequence) -> int | None:
        """Prompt + expected output of `seq` (None: nothing learned yet)."""
        mean = self.estimator.mean(seq)
        if mean is None:
            return None
        cap = self.max_model_len - seq.num_prompt_tokens
        if seq.params.max_tokens is not None:
            cap = min(cap, seq.params.max_tokens)
        grown = len(seq.output_token_ids) + self.block_manager.block_size
        return seq.num_prompt_tokens + min(cap, max(round(mean), grown))

    def fits(self, seq: Sequence, running: list[Sequence], num_cached: int) -> bool:
        """Whether admitting `seq` (with `num_cached` tokens from the prefix cache) leaves
        room for its expected growth and that of the running requests."""
        if not running:
            return True
        want = self.expected_tokens(seq)
        if want is None:
            return True
        bm = self.block_manager
        growth = 0
        for r in running:
            expected = self.expected_tokens(r) or r.num_tokens
            growth += max(0, bm.blocks_needed(expected) - len(r.block_table))
        need = bm.blocks_needed(want) - num_cached // bm.block_size
        return need + growth <= bm.num_free_blocks

    def on_finished(self, seq: Sequence, reason: str) -> None:
        if reason in ("stop", "length"):
            self.estimator.observe(seq)


def cheapest_victim(candidates: list[Sequence]) -> Sequence:
    """The candidate whose preemption recomputes the fewest tokens; ties: the newest."""
    return min(candidates, key=lambda s: (s.num_computed_tokens, -s.arrival, -s.seq_no))
