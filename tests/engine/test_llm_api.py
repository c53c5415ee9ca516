"""The offline API as vLLM users call it: `LLM(...).generate(prompts, params, lora_request)`."""

from __future__ import annotations

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time there", "Trains leave the station"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)


def completion(llm: LLM, prompt, params: SamplingParams):
    outs = llm.generate(prompt, params)
    assert len(outs) == 1 and outs[0].finished
    return outs[0].outputs[0]


def assert_nothing_queued(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and engine.requests == {}
    engine.block_manager.check_all_free()


# ---------------------------------------------------------------------------- prompt shapes
def test_one_output_per_prompt_in_order(llm):
    alone = [completion(llm, p, GREEDY).token_ids for p in PROMPTS]
    assert len(set(map(tuple, alone))) == len(PROMPTS), "prompts should give distinct outputs"

    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert len({o.request_id for o in outs}) == len(PROMPTS)

    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    by_ids = llm.generate(ids, GREEDY)
    assert [o.prompt_token_ids for o in by_ids] == ids
    assert [o.outputs[0].token_ids for o in by_ids] == alone
    assert [o.outputs[0].text for o in by_ids] == [o.outputs[0].text for o in outs]

    single = llm.generate(ids[1], GREEDY)  # one token-id list is one prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == alone[1]
    assert llm.generate([], GREEDY) == []


def test_per_prompt_params(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]


# ---------------------------------------------------------------------------- finishing
def test_length_finish_at_max_tokens(llm):
    out = completion(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == llm.get_tokenizer().decode(out.token_ids)


def _first_unique_ascii(text: str, width: int = 3, start: int = 6) -> int:
    """Index of a printable-ASCII substring that first occurs there (a usable stop string)."""
    for i in range(start, len(text) - width):
        s = text[i : i + width]
        if all(c.isascii() and c.isprintable() for c in s) and text.find(s) == i:
            return i
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_generation_and_is_cut_from_text(llm):
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = completion(llm, PROMPTS[0], long)
    at = _first_unique_ascii(full.text)
    stop = full.text[at : at + 3]

    out = completion(
        llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    )
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:at]
    assert len(out.token_ids) < 24 and out.token_ids == full.token_ids[: len(out.token_ids)]

    kept = completion(
        llm,
        PROMPTS[0],
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert kept.text == full.text[: at + 3] and kept.stop_reason == stop

    # Of several stop strings, the one that appears first in the text wins.
    later = full.text[_first_unique_ascii(full.text, start=at + 3) :][:3]
    both = completion(
        llm,
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[later, stop]),
    )
    assert both.stop_reason == stop and both.text == full.text[:at]


def test_stop_token_id_ends_generation(llm):
    full = completion(
        llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    ids = full.token_ids
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    out = completion(
        llm,
        PROMPTS[1],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[ids[j]]),
    )
    assert out.finish_reason == "stop" and out.stop_reason == ids[j]
    assert out.token_ids == ids[: j + 1]
    assert full.text.startswith(out.text)


def test_min_tokens_holds_back_a_stop_token(llm):
    full = completion(
        llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    first = full.token_ids[0]
    out = completion(
        llm,
        PROMPTS[1],
        SamplingParams(
            temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True, stop_token_ids=[first]
        ),
    )
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert out.token_ids[0] != first


# ---------------------------------------------------------------------------- sampling
def test_seeded_request_is_reproducible_and_independent_of_neighbours(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = completion(llm, PROMPTS[0], seeded).token_ids
    assert completion(llm, PROMPTS[0], seeded).token_ids == alone
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),  # unseeded
        seeded,
        SamplingParams(temperature=0.7, seed=7, top_p=0.9, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    outs = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0]], neighbours)
    assert outs[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert completion(llm, PROMPTS[0], other_seed).token_ids != alone
    greedy = completion(
        llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ).token_ids
    assert alone != greedy, "temperature 1 on a random model should not be greedy"


def test_logprobs_when_asked(llm):
    out = completion(
        llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    )
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry
        assert 1 <= len(entry) <= 4 and all(v <= 0.0 for v in entry.values())
        assert entry[tok] == max(entry.values()), "greedy picks the most likely token"
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )

    only_chosen = completion(
        llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    )
    assert [list(e) for e in only_chosen.logprobs] == [[t] for t in only_chosen.token_ids]
    plain = completion(llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=3))
    assert plain.logprobs is None


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([[5] * 128], None, r"at most 128 tokens"),
        ([[5] * 120], SamplingParams(max_tokens=16), r"exceeds the context length 128"),
        ([[]], None, r"empty"),
        ([[5, 512]], None, r"token ids must lie in \[0, 512\)"),
        (["fine", [5] * 200], None, r"at most 128 tokens"),  # the first one is taken back
        (PROMPTS, [SamplingParams()] * 2, r"sampling_params: got 2 entries for 3 prompts"),
    ],
    ids=[
        "too-long",
        "too-long-with-output",
        "empty",
        "bad-token-id",
        "second-bad",
        "params-length",
    ],
)
def test_bad_input_raises_and_queues_nothing(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert_nothing_queued(llm)
    assert len(completion(llm, PROMPTS[0], GREEDY).token_ids) == 12


def test_mismatched_lora_list_raises(llm, tmp_path):
    loras = [LoRARequest("x", 1, str(tmp_path))]
    with pytest.raises(ValueError, match=r"lora_request: got 1 entries for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, loras)
    assert_nothing_queued(llm)
