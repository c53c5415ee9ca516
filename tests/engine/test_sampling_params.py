import pytest

from loraplex.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy and not p.has_penalties


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_integer_floats_are_accepted_as_floats() -> None:
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and p.repetition_penalty == 2.0


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": -1}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_off_values_are_accepted() -> None:
    p = SamplingParams(top_k=-1, max_tokens=None, min_tokens=100, logprobs=0, seed=0)
    assert p.max_tokens is None and p.logprobs == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 17}, r"n must be between 1 and 16"),
        ({"n": 3, "best_of": 2}, r"best_of must be between n \(3\) and 16"),
        ({"temperature": -0.5}, r"temperature must be >= 0"),
        ({"temperature": "hot"}, r"temperature must be a number"),
        ({"temperature": None}, r"temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\].*1\.0 to turn"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be >= 1, or 0 / -1"),
        ({"top_k": 2.5}, r"top_k must be an integer"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 \(1 turns it off\)"),
        ({"max_tokens": -1}, r"max_tokens must be >= 1 \(0: compute the prompt only"),
        ({"min_tokens": -1}, r"min_tokens must be >= 0"),
        ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens \(20\) must not exceed max_tokens"),
        ({"logprobs": 21}, r"logprobs must be between 0 and 20"),
        ({"logprobs": -1}, r"logprobs must be between 0 and 20"),
        ({"stop": [""]}, r"non-empty strings"),
        ({"stop": ["ok", 3]}, r"non-empty strings.*stop_token_ids"),
        ({"stop": 3}, r"stop must be a string or a list of strings"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be non-negative integers"),
        ({"stop_token_ids": 7}, r"stop_token_ids must be a list"),
        ({"seed": "abc"}, r"seed must be an integer or None"),
        ({"seed": 2**70}, r"seed must fit in 64 bits"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be true or false"),
        ({"max_tokens": True}, r"max_tokens must be an integer or None"),
    ],
)
def test_invalid_values_raise_a_helpful_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
