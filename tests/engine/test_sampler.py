import math

import pytest
import torch

from loraplex.engine.sampling.sampler import Sampler, SamplerOutput, make_generator
from loraplex.engine.sampling_params import SamplingParams

EOS = 0
VOCAB = 64


def run(
    sampler: Sampler,
    logits: torch.Tensor,  # [rows, vocab]
    params: list[SamplingParams],
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    gens: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    rows = len(params)
    return sampler(
        logits,
        params,
        prompt or [[] for _ in range(rows)],
        output or [[] for _ in range(rows)],
        gens or [None] * rows,
    )


def probs_logits(*probs: float) -> torch.Tensor:  # [1, len(probs)]
    return torch.tensor([probs]).log()


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(eos_token_ids={EOS}, seed=1234)


@pytest.fixture
def logits() -> torch.Tensor:  # [8, VOCAB]
    return torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(sampler: Sampler, logits: torch.Tensor, dtype: torch.dtype) -> None:
    x = logits.to(dtype)
    out = run(sampler, x, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == x.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


def test_top_k_1_equals_greedy(sampler: Sampler, logits: torch.Tensor) -> None:
    for _ in range(5):
        out = run(sampler, logits, [SamplingParams(temperature=1.5, top_k=1)] * 8)
        assert out.token_ids == logits.argmax(-1).tolist()


def seeded_tokens(sampler: Sampler, row: torch.Tensor, seed: int, steps: int = 20) -> list[int]:
    gen = make_generator(seed, "cpu")
    return [
        run(sampler, row[None], [SamplingParams(seed=seed)], gens=[gen]).token_ids[0]
        for _ in range(steps)
    ]


def test_same_seed_gives_same_tokens_across_calls(logits: torch.Tensor) -> None:
    flat = logits[0] / 10  # flat enough that draws vary
    a = seeded_tokens(Sampler({EOS}), flat, seed=42)
    b = seeded_tokens(Sampler({EOS}), flat, seed=42)
    assert a == b and len(set(a)) > 3


def test_different_seeds_differ(sampler: Sampler, logits: torch.Tensor) -> None:
    flat = logits[0] / 10
    assert seeded_tokens(sampler, flat, seed=1) != seeded_tokens(sampler, flat, seed=2)


@pytest.mark.parametrize("position", [0, 2, 5])
def test_seeded_tokens_do_not_depend_on_the_batch(
    sampler: Sampler, logits: torch.Tensor, position: int
) -> None:
    flat = logits[0] / 10
    alone = seeded_tokens(sampler, flat, seed=7)

    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8, seed=99),
        SamplingParams(top_k=5, min_p=0.1),
        SamplingParams(repetition_penalty=1.3),
    ]
    mine = SamplingParams(seed=7)
    params = others[:position] + [mine] + others[position:]
    batch = torch.cat([logits[1 : position + 1], flat[None], logits[position + 1 : 6]])
    gens = [make_generator(p.seed, "cpu") for p in params]
    together = [
        run(sampler, batch, params, prompt=[[1, 2]] * 6, gens=gens).token_ids[position]
        for _ in range(20)
    ]
    assert together == alone


def draw_counts(sampler: Sampler, row: torch.Tensor, params: SamplingParams, draws: int) -> list:
    out = run(sampler, row.expand(draws, -1), [params] * draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=row.shape[-1]).tolist()


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_reshapes_the_distribution(sampler: Sampler, temperature: float) -> None:
    base = [0.5, 0.3, 0.15, 0.05]
    scaled = [q ** (1 / temperature) for q in base]
    expected = [q / sum(scaled) for q in scaled]
    counts = draw_counts(
        sampler, probs_logits(*base), SamplingParams(temperature=temperature), 20_000
    )
    # 3 degrees of freedom: 16.3 is the p = 0.001 critical value.
    assert chi_square(counts, expected) < 16.3
    if temperature != 1.0:
        assert chi_square(counts, base) > 100  # and clearly not the untempered distribution


def test_top_k_keeps_only_the_k_best(sampler: Sampler) -> None:
    row = torch.linspace(0.0, 1.0, VOCAB)[None]  # token VOCAB-1 is best
    counts = draw_counts(sampler, row, SamplingParams(top_k=3), 3000)
    assert {t for t, c in enumerate(counts) if c} == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_k_applies_only_to_rows_that_ask(sampler: Sampler) -> None:
    row = torch.linspace(0.0, 1.0, VOCAB)[None]
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_k=4)] * 500
    out = run(sampler, row.expand(len(params), -1), params)
    by_kind = [set(out.token_ids[start::3]) for start in range(3)]
    assert by_kind[0] == {VOCAB - 1, VOCAB - 2}
    assert len(by_kind[1]) > 20  # untruncated
    assert by_kind[2] == {VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4}


def test_small_top_p_keeps_only_the_top_token(sampler: Sampler) -> None:
    counts = draw_counts(
        sampler, probs_logits(0.3, 0.25, 0.25, 0.2), SamplingParams(top_p=0.01), 2000
    )
    assert counts == [2000, 0, 0, 0]


def test_top_p_keeps_the_smallest_set_reaching_p(sampler: Sampler) -> None:
    counts = draw_counts(sampler, probs_logits(0.4, 0.3, 0.2, 0.1), SamplingParams(top_p=0.5), 4000)
    assert counts[0] > 0 and counts[1] > 0 and counts[2:] == [0, 0]
    # The survivors are renormalised: 0.4 : 0.3.
    assert chi_square(counts[:2], [4 / 7, 3 / 7]) < 10.8


def test_top_k_then_top_p_combine(sampler: Sampler) -> None:
    # top_k=2 leaves 0.5/0.3 → renormalised 0.625/0.375; top_p=0.6 then keeps only the first.
    counts = draw_counts(
        sampler, probs_logits(0.5, 0.3, 0.2), SamplingParams(top_k=2, top_p=0.6), 1000
    )
    assert counts == [1000, 0, 0]


def test_top_k_and_top_p_rows_mix_in_one_batch(sampler: Sampler) -> None:
    row = probs_logits(0.4, 0.3, 0.2, 0.1)
    params = [SamplingParams(top_k=3, top_p=0.99), SamplingParams(top_p=0.5), SamplingParams()]
    out = run(sampler, row.expand(3000, -1), params * 1000)
    by_kind = [set(out.token_ids[start::3]) for start in range(3)]
    assert by_kind == [{0, 1, 2}, {0, 1}, {0, 1, 2, 3}]


def test_min_p_drops_tokens_below_a_fraction_of_the_best(sampler: Sampler) -> None:
    # min_p 0.4 of the best 0.5 → tokens under 0.2 go.
    counts = draw_counts(
        sampler, probs_logits(0.5, 0.3, 0.15, 0.05), SamplingParams(min_p=0.4), 4000
    )
    assert counts[0] > 0 and counts[1] > 0 and counts[2:] == [0, 0]


def greedy_after(
    sampler: Sampler, logits: torch.Tensor, prompt: list[int], output: list[int], **penalties: float
) -> int:
    params = SamplingParams(temperature=0.0, **penalties)
    return run(sampler, logits, [params], prompt=[prompt], output=[output]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(
    sampler: Sampler,
) -> None:
    pos = torch.tensor([[2.0, 1.9, 0.5]])
    assert greedy_after(sampler, pos, [0], [], repetition_penalty=1.0) == 0
    assert greedy_after(sampler, pos, [0], [], repetition_penalty=1.5) == 1  # prompt counts
    assert greedy_after(sampler, pos, [], [0], repetition_penalty=1.5) == 1  # and output
    neg = torch.tensor([[-1.0, -1.2, -3.0]])
    assert greedy_after(sampler, neg, [0], [], repetition_penalty=2.0) == 1  # -1 → -2
    # Below 1 it rewards repeats instead.
    assert greedy_after(sampler, pos, [1], [], repetition_penalty=0.5) == 1


def test_presence_penalty_counts_generated_tokens_once(sampler: Sampler) -> None:
    x = torch.tensor([[1.0, 0.6, 0.0]])
    assert greedy_after(sampler, x, [0, 0], [], presence_penalty=0.5) == 0  # prompt ignored
    assert greedy_after(sampler, x, [], [0], presence_penalty=0.5) == 1
    assert greedy_after(sampler, x, [], [1, 1, 1], presence_penalty=-0.5) == 1  # boosts


def test_frequency_penalty_scales_with_the_count(sampler: Sampler) -> None:
    x = torch.tensor([[1.0, 0.6, 0.0]])
    assert greedy_after(sampler, x, [], [0], frequency_penalty=0.2) == 0  # 1.0 - 0.2
    assert greedy_after(sampler, x, [], [0, 0, 0], frequency_penalty=0.2) == 1  # 1.0 - 0.6


def test_penalties_stay_in_their_row(sampler: Sampler) -> None:
    x = torch.tensor([[1.0, 0.6, 0.0]]).repeat(3, 1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    out = run(sampler, x, params, prompt=[[0]] * 3, output=[[0]] * 3)
    assert out.token_ids == [0, 1, 1]


def test_min_tokens_masks_eos_and_stop_ids(sampler: Sampler) -> None:
    x = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # EOS best, then stop id 1
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert run(sampler, x, [p], output=[[3]]).token_ids == [2]
    assert run(sampler, x, [p], output=[[3, 3]]).token_ids == [0]  # reached: EOS allowed
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert run(sampler, x, [ignore], output=[[3]]).token_ids == [0]  # EOS does not stop anyway


def test_min_tokens_masks_sampled_rows_too(sampler: Sampler) -> None:
    counts = draw_counts(sampler, probs_logits(0.7, 0.2, 0.1), SamplingParams(min_tokens=1), 2000)
    assert counts[EOS] == 0 and counts[1] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_of_the_raw_distribution(
    sampler: Sampler, logits: torch.Tensor, dtype: torch.dtype
) -> None:
    x = logits[:3].to(dtype)
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=5, seed=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
    ]
    out = run(
        sampler, x, params, prompt=[[1, 2, 3]] * 3, gens=[make_generator(3, "cpu"), None, None]
    )
    raw = torch.log_softmax(x.float(), dim=-1)  # [3, VOCAB]
    for row in (0, 1):
        assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-5)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-5)
    lps = [v for _, v in out.top_logprobs[0]]
    assert lps == sorted(lps, reverse=True)
    assert out.top_logprobs[1] == []  # logprobs=0: only the chosen token's
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert all(math.isfinite(v) for v in out.logprobs[:2])


def test_bf16_sampling_returns_valid_tokens(sampler: Sampler, logits: torch.Tensor) -> None:
    x = logits.to(torch.bfloat16)
    params = [SamplingParams(top_p=0.9, top_k=10, min_p=0.05, frequency_penalty=0.5)] * 8
    out = run(sampler, x, params, output=[[1, 2]] * 8)
    top10 = x.float().topk(10).indices.tolist()
    assert all(t in top10[i] for i, t in enumerate(out.token_ids))


def test_tiny_temperature_is_greedy_not_nan(sampler: Sampler, logits: torch.Tensor) -> None:
    out = run(sampler, logits * 1e4, [SamplingParams(temperature=1e-7)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [50, 100, 4096, 32000, 32001, 128256, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_argmax_equals_argmax_with_first_tie(vocab: int, dtype: torch.dtype) -> None:
    from loraplex.engine.sampling.sampler import _argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    x[1, vocab // 2] = x[1, vocab - 1] = 50.0  # tie across blocks: the first wins
    x[2, 3] = x[2, 5] = 50.0  # tie inside one block
    x[3] = float("-inf")
    x[3, vocab - 1] = 0.0  # the last column
    x[4, :] = 1.0  # all equal: column 0
    x[5, 0] = 50.0
    expected = torch.tensor([int(r.float().argmax()) for r in x])  # first max, per row
    assert torch.equal(_argmax(x), expected)
    assert torch.equal(_argmax(x.t().contiguous().t()), expected)  # a strided view
    assert _argmax(x[:, : vocab // 2]).tolist() == x[:, : vocab // 2].float().argmax(-1).tolist()


def test_owned_logits_are_masked_in_place_unless_logprobs_need_them(sampler: Sampler) -> None:
    x = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # EOS best
    banned = SamplingParams(temperature=0.0, min_tokens=1)
    kept = x.clone()
    assert run(sampler, x, [banned]).token_ids == [1]
    assert torch.equal(x, kept)  # not owned: the caller's logits are untouched
    out = sampler(x, [banned], [[]], [[]], [None], logits_owned=True)
    assert out.token_ids == [1] and x[0, EOS] == float("-inf")  # no copy made
    # With logprobs the raw distribution is still reported, owned or not.
    asked = SamplingParams(temperature=0.0, min_tokens=1, logprobs=1)
    x = kept.clone()
    out = sampler(x, [asked], [[]], [[]], [None], logits_owned=True)
    assert torch.equal(x, kept)
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(kept, -1)[0, 1].item())


@pytest.mark.parametrize("peaked", [True, False], ids=["peaked", "flat"])
def test_top_p_over_the_best_candidates_equals_the_full_sort(monkeypatch, peaked: bool) -> None:
    """top_p without top_k looks at each row's TOP_P_CANDIDATES best tokens first: where they
    hold the mass top_p keeps (a peaked distribution) the mask is the full sort's, exactly;
    where they do not (flat) it falls back to the full sort. Rows with a small top_k mix in."""
    from loraplex.engine.sampling import sampler as sampler_mod

    gen = torch.Generator().manual_seed(7)
    vocab = 5000
    x = torch.randn(4, vocab, generator=gen) * (6.0 if peaked else 0.1)
    top_k, top_p = [vocab, 50, vocab, vocab], [0.9, 0.8, 0.5, 0.99]
    calls = []
    real = sampler_mod._top_p_partial
    monkeypatch.setattr(sampler_mod, "_top_p_partial", lambda *a: calls.append(r := real(*a)) or r)
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", 256)
    got = sampler_mod._top_k_top_p(x.clone(), top_k, top_p)
    assert len(calls) == (1 if peaked else 2) and (calls[0] is None) == (not peaked)
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", vocab)  # the full sort
    want = sampler_mod._top_k_top_p(x.clone(), top_k, top_p)
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])
    kept = got.isfinite().sum(-1).tolist()
    assert kept[1] <= 50 and all(0 < n < vocab for n in kept)
