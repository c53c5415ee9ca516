"""Turns one step's logits into next tokens, batched across requests with mixed parameters.

Per row, in order: repetition penalty → frequency/presence penalties → the request's logits
processors (logit_bias, grammars: engine/sampling/logits_processors.py, one batched call per
processor class) → min_tokens masking of EOS/stop ids → greedy rows take the argmax; the others go
through temperature → top_k → top_p → min_p and are drawn with the exponential race
`argmax(probs / E)`, `E ~ Exp(1)`, whose noise for a seeded request comes from that request's
own generator, so its tokens do not depend on which other requests share the batch. Reported
logprobs are those of the raw model distribution (before penalties, processors, temperature
and truncation), as OpenAI reports them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from loraplex.engine.sampling.logits_processors import LogitsProcessor, apply_processors
from loraplex.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


_ARGMAX_BLOCKS = (1024, 512, 256, 128, 64, 32)  # widest first


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first one on ties (as argmax). [rows, vocab] -> [rows]."""
    return _argmax_max(x)[0]


def _argmax_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`_argmax`, each row's maximum) of [rows, vocab]; a row holding NaN has NaN for its
    maximum (torch's max propagates it), so the values tell non-finite rows at no extra pass.

    On the CPU a reduction that tracks indices is several times slower than a plain `amax`.
    So: the maximum of each block of columns, the first best block per row, then the first
    best column inside it. The widest block that divides the vocabulary is the cheapest,
    in bf16 most. (Figures: docs/benchmarks.md, "Measurements behind choices in the code";
    `python -m benchmarks.cpu_micro argmax` measures them again.)
    """
    rows, vocab = x.shape
    width = next((w for w in _ARGMAX_BLOCKS if vocab % w == 0 and vocab >= 4 * w), None)
    if width is None or x.is_cuda:
        top, index = x.max(dim=-1)
        return index, top
    blocks = x.reshape(rows, vocab // width, width)
    top, best = blocks.amax(dim=-1).max(dim=-1)  # [rows] first block holding the max
    inner = blocks[torch.arange(rows, device=x.device), best].max(dim=-1).indices
    return best * width + inner, top


@dataclass
class SamplerOutput:
    """One entry per input row. Rows whose params have `logprobs=None` get None entries."""

    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), best first
    # rows whose raw logits hold NaN or +inf, or are all -inf: no distribution to draw from
    # (an adapter of absurd magnitude). Their token and logprobs are meaningless (None), and
    # their values took no part in any decision shared by the batch.
    nonfinite: list[int] = field(default_factory=list)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator the engine keeps for the request's lifetime (None: unseeded)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int], seed: int | None = None) -> None:
        """`seed` fixes the generator shared by unseeded requests (tests); None: random."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab], any float dtype
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        processors: list[list[LogitsProcessor]] | None = None,  # per row, possibly empty
        logits_owned: bool = False,  # the caller will not read `logits` again: may be changed
    ) -> SamplerOutput:
        rows, vocab = logits.shape
        assert len(params) == len(prompt_ids) == len(output_ids) == len(generators) == rows
        masked = self._min_tokens_mask(params, output_ids, vocab)
        processed = processors is not None and any(processors)
        plain = all(p.greedy and not p.has_penalties for p in params)
        if not masked[0] and not processed and plain:
            # Hot path: argmax is exact in any float dtype, so no float32 copy is needed.
            token_ids, top = _argmax_max(logits)  # [rows], [rows]
            bad = _nonfinite_rows(top)
        else:
            bad = _nonfinite_rows(logits.amax(dim=-1))
            # Owned float32 logits are masked in place unless a row needs the raw distribution
            # for its logprobs (the copy: 32 MB a step at batch 32 and a 262k vocabulary).
            raw = any(p.logprobs is not None or p.best_of for p in params)
            in_place = logits_owned and logits.dtype == torch.float32 and not raw
            x = logits if in_place else logits.to(torch.float32, copy=True)  # [rows, vocab]
            if bad:  # neutral rows instead: a NaN must not steer a choice made for the batch
                x[bad] = 0.0
            self._apply_penalties(x, params, prompt_ids, output_ids)
            if processed:
                apply_processors(x, processors)
            if masked[0]:
                rows_t, cols_t = torch.tensor(masked, device=x.device)  # [2, num_masked]
                x[rows_t, cols_t] = _NEG_INF
            token_ids = _argmax(x)  # [rows]
            sample_rows = [i for i, p in enumerate(params) if not p.greedy and i not in bad]
            if sample_rows:
                idx = torch.tensor(sample_rows, device=x.device)
                token_ids[idx] = self._sample(
                    x[idx],
                    [params[i] for i in sample_rows],
                    [generators[i] for i in sample_rows],
                )
        ids = token_ids.tolist()
        chosen, top = self._logprobs(logits, params, token_ids, bad)
        return SamplerOutput(token_ids=ids, logprobs=chosen, top_logprobs=top, nonfinite=bad)

    def _min_tokens_mask(
        self, params: list[SamplingParams], output_ids: list[list[int]], vocab: int
    ) -> tuple[list[int], list[int]]:
        """(row, token) pairs that may not be produced yet because min_tokens is not reached."""
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if len(output_ids[i]) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned |= self.eos_token_ids
            # Ids past the logits' width cannot be produced anyway.
            banned = sorted(t for t in banned if t < vocab)
            rows += [i] * len(banned)
            cols += banned
        return rows, cols

    def _apply_penalties(
        self,
        x: torch.Tensor,  # [rows, vocab] float32, changed in place
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> None:
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            idx = torch.tensor(rep, device=x.device)
            seen = (
                _token_counts([prompt_ids[i] + output_ids[i] for i in rep], x.shape[1], x.device)
                > 0
            )  # [len(rep), vocab]
            r = _column([params[i].repetition_penalty for i in rep], x.device)  # [len(rep), 1]
            sub = x[idx]
            x[idx] = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)

        pen = [
            i
            for i, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        if pen:
            idx = torch.tensor(pen, device=x.device)
            counts = _token_counts([output_ids[i] for i in pen], x.shape[1], x.device)
            freq = _column([params[i].frequency_penalty for i in pen], x.device)
            pres = _column([params[i].presence_penalty for i in pen], x.device)
            x[idx] -= freq * counts + pres * (counts > 0)

    def _sample(
        self,
        x: torch.Tensor,  # [rows, vocab] float32 penalised logits of the sampling rows
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [rows] int64
        rows, vocab = x.shape
        x = x / _column([p.temperature for p in params], x.device)

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_p:
            x = _top_k_top_p(x, top_k, [p.top_p for p in params])
        elif min(top_k) < vocab:
            k_max = max(k for k in top_k if k < vocab)
            k = torch.tensor(top_k, device=x.device)  # [rows]
            kth = x.topk(k_max, dim=-1).values  # [rows, k_max], best first
            kth = kth.gather(1, (k.clamp(max=k_max) - 1)[:, None])  # [rows, 1]
            kth[k >= vocab] = _NEG_INF  # rows without top_k keep everything
            x = x.masked_fill(x < kth, _NEG_INF)

        probs = torch.softmax(x, dim=-1)  # [rows, vocab]
        if any(p.min_p > 0.0 for p in params):
            min_p = _column([p.min_p for p in params], x.device)
            floor = min_p * probs.max(dim=-1, keepdim=True).values  # [rows, 1]
            probs = probs.masked_fill(probs < floor, 0.0)

        noise = torch.empty_like(probs)  # [rows, vocab] ~ Exp(1)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == rows:
            noise.exponential_(generator=self._default_generator(x.device))
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=x.device).exponential_(
                generator=self._default_generator(x.device)
            )
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        # A zero draw would turn 0/0 into NaN for filtered tokens.
        return _argmax(probs / noise.clamp_min_(1e-20))

    def _logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor,
        bad: list[int] = (),
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:  # fmt: skip
        """Rows in `bad` get none. A finite row's logprobs are finite or -inf (a token its
        logits rule out): -inf is reported as LOGPROB_FLOOR, as vLLM does, since JSON has no
        infinity."""
        rows = len(params)
        chosen: list[float | None] = [None] * rows
        top: list[list[tuple[int, float]] | None] = [None] * rows
        # best_of ranks samples by cumulative logprob: the chosen token's is always needed.
        skip = set(bad)
        asked = [i for i, p in enumerate(params)
                 if (p.logprobs is not None or p.best_of) and i not in skip]  # fmt: skip
        if not asked:
            return chosen, top
        idx = torch.tensor(asked, device=logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [len(asked), vocab]
        chosen_lp = lp.gather(1, token_ids[idx][:, None]).squeeze(1)
        chosen_lp = chosen_lp.clamp_min_(LOGPROB_FLOOR).tolist()
        k_max = max(params[i].logprobs or 0 for i in asked)
        top_vals, top_ids = lp.topk(k_max, dim=-1)  # [len(asked), k_max], sorted
        top_vals, top_ids = top_vals.clamp_min_(LOGPROB_FLOOR).tolist(), top_ids.tolist()
        for j, i in enumerate(asked):
            k = params[i].logprobs or 0
            chosen[i] = chosen_lp[j]
            top[i] = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        return chosen, top

    def _default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._default_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._default_generators[device] = gen
        return gen


# The logprob reported for a token of probability 0 (vLLM's value for -inf)
LOGPROB_FLOOR = -9999.0


def _nonfinite_rows(top: torch.Tensor) -> list[int]:
    """The rows whose maximum `top` [rows] is not finite: NaN or +inf somewhere, or nothing
    but -inf. One sum and one read in the common case of none."""
    if math.isfinite(top.sum().item()):
        return []
    return (~torch.isfinite(top)).nonzero().flatten().tolist()


def _column(values: list[float], device: torch.device) -> torch.Tensor:  # [len(values), 1]
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [len(seqs), vocab] float32."""
    width = max(1, max(len(s) for s in seqs))
    # Padding points at an extra column that is dropped, so rows of any length share a tensor.
    padded = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], device=device)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


# top_p without top_k first tries this many best tokens per row (then 16 times as many):
# when they already hold the mass top_p keeps, the rest would be dropped anyway and a partial
# sort replaces a full one (a full sort of a large vocabulary costs far more than a topk of
# 1024: docs/cpu-path.md).
TOP_P_CANDIDATES = 1024


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top_k and then top_p drop; one sort serves both. x: [rows, vocab]."""
    vocab = x.shape[1]
    width = max(top_k)
    if width >= vocab and all(q < 1.0 for q in top_p):
        for candidates in (TOP_P_CANDIDATES, 16 * TOP_P_CANDIDATES):
            if candidates >= vocab:
                break
            masked = _top_p_partial(x, top_k, top_p, candidates)
            if masked is not None:
                return masked
    if width < vocab:
        # Every row truncates to at most `width` tokens: a partial sort is much cheaper.
        sorted_x, order = x.topk(width, dim=-1)  # [rows, width], best first
    else:
        sorted_x, order = x.sort(dim=-1, descending=True)  # [rows, vocab]
    k = torch.tensor(top_k, device=x.device)[:, None]  # [rows, 1]
    rank = torch.arange(width, device=x.device)[None, :]  # [1, width]
    sorted_x = sorted_x.masked_fill(rank >= k, _NEG_INF)
    probs = torch.softmax(sorted_x, dim=-1)  # renormalised over the top_k survivors
    return _drop_past_top_p(x, sorted_x, order, probs, top_p)


def _drop_past_top_p(x, sorted_x, order, probs, top_p: list[float]) -> torch.Tensor:
    mass_before = probs.cumsum(dim=-1) - probs  # [rows, width]
    # p = 1 must keep everything, even where rounding pushes the running sum to 1.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=x.device)
    sorted_x = sorted_x.masked_fill(mass_before >= p[:, None], _NEG_INF)
    return torch.full_like(x, _NEG_INF).scatter_(1, order, sorted_x)


def _top_p_partial(x, top_k: list[int], top_p: list[float], width: int) -> torch.Tensor | None:
    """`_top_k_top_p` over each row's `width` best tokens only, when that is exact: every row
    has top_p < 1, rows with a top_k have it within `width`, and the others' `width` best
    tokens hold at least their top_p of the whole distribution. None otherwise."""
    vocab = x.shape[1]
    if any(width < k < vocab for k in top_k):
        return None
    sorted_x, order = x.topk(width, dim=-1)  # [rows, width], best first
    k = torch.tensor(top_k, device=x.device)[:, None]
    rank = torch.arange(width, device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(rank >= k, _NEG_INF)
    probs = torch.softmax(sorted_x, dim=-1)  # top_k rows: renormalised over their survivors
    full = [i for i, kk in enumerate(top_k) if kk >= vocab]
    if full:  # no top_k: probabilities of the whole vocabulary
        lse = torch.logsumexp(x[full], dim=-1, keepdim=True)
        whole = torch.exp(sorted_x[full] - lse)
        p = torch.tensor([top_p[i] for i in full], device=x.device)
        if not bool((whole.sum(dim=-1) >= p).all()):
            return None  # the tail holds mass top_p would keep: needs the full sort
        probs[full] = whole
    return _drop_past_top_p(x, sorted_x, order, probs, top_p)
