"""Prompt logprobs (SamplingParams.prompt_logprobs): scoring the prompt's own tokens.

The model's row at position p is the distribution of the token at p + 1, so a prefill chunk
of positions [start, end) scores prompt positions start + 1 .. end, except the prompt's last
row, which is the first output token's distribution (the sampler's row). Only the requests
that ask run their prompt rows through the LM head, ROWS_PER_CHUNK rows at a time (a 262k
vocabulary makes each row's float32 logits 1 MiB).

    prompt      t0    t1    t2    t3   | out0
    row p        0     1     2     3
    scores      t1    t2    t3   (out0: sampled)

A sequence keeps what was scored (`Sequence.prompt_logprobs`); a recompute after preemption
scores only positions not scored yet, and the prefix cache never serves an unscored row
(`Sequence.max_cached_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.sequence import Sequence

# LM-head rows per pass: bounds the float32 [rows, vocab] logits (and their log-softmax) to
# 64 MiB each at Gemma's 262k vocabulary, however long the prompt.
ROWS_PER_CHUNK = 64


@dataclass
class PromptRows:
    """The rows of one step's hidden states that score prompt positions."""

    rows: list[int] = field(default_factory=list)  # row in the step's flat batch
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    seqs: list[Sequence] = field(default_factory=list)  # whose prompt, per row

    def add(self, seq: Sequence, row0: int, start: int, n: int) -> None:
        """`seq` computes positions [start, start + n) at rows row0...: take the rows that
        score prompt positions not scored yet."""
        if seq.prompt_scored:
            return
        first = max(start, len(seq.prompt_logprobs) - 1)
        end = min(start + n, seq.num_prompt_tokens - 1)
        for p in range(first, end):
            self.rows.append(row0 + p - start)
            self.targets.append(seq.prompt_token_ids[p + 1])
            self.seqs.append(seq)


def score_prompt_rows(model: DecoderLM, hidden: torch.Tensor, batch: PromptRows) -> None:
    """Append each row's scores to its sequence's `prompt_logprobs`, in position order.

    hidden: [num_tokens, hidden], the step's final hidden states. The logprobs are those
    completion logprobs use: log_softmax in float32 of the LM head's logits (softcap
    included), before any penalty or processor.
    """
    dev = hidden.device
    for lo in range(0, len(batch.rows), ROWS_PER_CHUNK):
        hi = min(lo + ROWS_PER_CHUNK, len(batch.rows))
        seqs = batch.seqs[lo:hi]
        rows = torch.tensor(batch.rows[lo:hi], device=dev)
        targets = torch.tensor(batch.targets[lo:hi], device=dev)[:, None]  # [rows, 1]
        logits = model.compute_logits(hidden[rows])  # [rows, vocab]
        lp = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
        del logits
        chosen = lp.gather(1, targets)  # [rows, 1]
        # Rank as vLLM counts it: 1 + the tokens strictly more likely.
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        k_max = max(s.params.prompt_logprobs for s in seqs)
        top_vals, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0])
        top_vals, top_ids = top_vals.tolist(), top_ids.long().tolist()
        chosen = chosen.squeeze(1).tolist()
        for j, seq in enumerate(seqs):
            pl, k = seq.prompt_logprobs, seq.params.prompt_logprobs
            pl.token_logprobs.append(chosen[j])
            pl.ranks.append(ranks[j])
            pl.top.append(list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)))
