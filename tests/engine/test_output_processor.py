"""The output processor on its own: stop decisions, held-back text, best_of ranking."""

from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.output_processor import OutputProcessor, Stop
from loraplex.engine.sequence import Sequence, SequenceStatus


@pytest.fixture(scope="module")
def tok(tiny_models) -> Tokenizer:
    return Tokenizer.from_dir(tiny_models["llama"])


def feed(proc: OutputProcessor, sample, tokens: list[int]) -> Stop | None:
    for t in tokens:
        sample.seq.output_token_ids.append(t)
        stop = proc.check_stop(sample)
        if stop is not None:
            return stop
    return None


def text_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make(proc, params: SamplingParams, n: int = 1):
    seqs = [Sequence("r", [1, 2, 3], params, index=i) for i in range(n)]
    return proc.new_request(None, seqs)


def test_stop_string_is_cut_and_never_streamed(tok):
    proc = OutputProcessor(tok, {0}, max_model_len=512)
    state = make(proc, SamplingParams(stop=["lazy dog"], max_tokens=100))
    (sample,) = state.samples
    streamed = ""
    stop = None
    for t in text_ids(tok, "the quick brown fox jumps over the lazy dog again"):
        sample.seq.output_token_ids.append(t)
        stop = proc.check_stop(sample)
        if stop is not None:
            sample.seq.status, sample.seq.finish_reason = SequenceStatus.FINISHED, stop.reason
            sample.seq.stop_reason = stop.stop_reason
            proc.finished(sample)
        streamed += state.output().delta_text
        if stop is not None:
            break
    assert stop == Stop("stop", "lazy dog")
    assert streamed == sample.text == "the quick brown fox jumps over the "
    assert "lazy" not in streamed


def test_stop_order_min_tokens_eos_stop_ids_and_limits(tok):
    proc = OutputProcessor(tok, {0}, max_model_len=8)
    s = make(proc, SamplingParams(min_tokens=2, stop_token_ids=[7])).samples[0]
    assert feed(proc, s, [0]) is None  # EOS before min_tokens is ignored
    assert feed(proc, s, [7]) == Stop("stop", 7)
    s = make(proc, SamplingParams(ignore_eos=True, max_tokens=3)).samples[0]
    assert feed(proc, s, [0, 0, 0]) == Stop("length")
    s = make(proc, SamplingParams(max_tokens=None)).samples[0]
    assert feed(proc, s, [5, 6, 8, 9, 5]) == Stop("length")  # 3 + 5 = the context limit
    s = make(proc, SamplingParams()).samples[0]
    assert feed(proc, s, [5, 0]) == Stop("stop", None)


def test_best_of_returns_only_the_n_best_at_the_end(tok):
    proc = OutputProcessor(tok, {0}, max_model_len=512)
    state = make(proc, SamplingParams(n=2, best_of=3, max_tokens=2), n=3)
    for sample, lps in zip(state.samples, ([-3.0, -1.0], [-0.5, -0.5], [-2.0, -0.1]), strict=True):
        sample.seq.output_token_ids += [5, 6]
        sample.seq.logprobs += lps
        sample.seq.top_logprobs += [[], []]
        assert state.output() is None  # nothing streams before the ranking is known
        sample.seq.status, sample.seq.finish_reason = SequenceStatus.FINISHED, "length"
    out = state.output()
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert [c.cumulative_logprob for c in out.outputs] == [-1.0, -2.1]
    assert all(c.logprobs is None for c in out.outputs)


def test_cumulative_logprob_is_the_sum_of_the_logprobs_as_they_grow_are_cut_and_replaced(tok):
    # Kept as a running sum (not re-summed per output): it must equal sum() of the sample's
    # logprobs after each output, also once the list is cut (a stop) and grown again, or
    # replaced (a resumed sequence).
    proc = OutputProcessor(tok, {0}, max_model_len=512)
    state = make(proc, SamplingParams(ignore_eos=True, max_tokens=100))
    (sample,) = state.samples
    seq = sample.seq
    assert state.output().outputs[0].cumulative_logprob is None
    for grow in ([-0.25, -1.5], [-0.125], [-3.0, -0.5, -0.0625]):
        seq.output_token_ids += [5] * len(grow)
        seq.logprobs += grow
        seq.top_logprobs += [[]] * len(grow)
        assert state.output().outputs[0].cumulative_logprob == sum(seq.logprobs)
    del seq.output_token_ids[3:], seq.logprobs[3:], seq.top_logprobs[3:]
    seq.output_token_ids += [6, 6, 6]
    seq.logprobs += [-7.0, -0.75, -2.0]
    seq.top_logprobs += [[], [], []]
    assert state.output().outputs[0].cumulative_logprob == sum(seq.logprobs) == -11.625
    seq.logprobs = [-0.5]
    assert state.output().outputs[0].cumulative_logprob == -0.5
