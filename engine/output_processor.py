"""Output processing: a request's new tokens -> text, stop decisions and `RequestOutput`s.

Per sample (`SampleState`): incremental detokenisation, stop conditions in OpenAI / vLLM
order (stop token ids, EOS, stop strings — with the text that may still become a stop string
held back from streaming — a logits processor that is done, then max_tokens and the context
limit), logprob entries built once per token, and how much was already delivered.
Per request (`RequestState`): its samples (n / best_of), the ranking of best_of, the output.

The processor decides; the engine acts: `check_stop` returns a `Stop` and the engine frees
the sequence's blocks and adapter, then calls `finished` here to settle the text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplex.engine.models.tokenizer import IncrementalDetokenizer, Tokenizer
from loraplex.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loraplex.engine.sequence import Sequence


@dataclass(frozen=True)
class Stop:
    reason: str  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class SampleState:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop_holdback: int = 0  # a stop string may still complete over this many trailing chars
    text: str = ""
    sent_text: int = 0  # chars of `text` already delivered
    sent_tokens: int = 0
    checked: int = 0  # output tokens already taken in by check_stop
    logprobs: list[dict[int, float]] = field(default_factory=list)  # built once per token
    # The running sum of seq.logprobs[:summed], added in order (what `sum` of them gives):
    # summing the whole list per output made each output cost O(tokens so far).
    summed: int = 0
    logprob_sum: float = 0.0
    summed_of: list[float] | None = None  # the list it was summed from
    summed_last: float | None = None  # the very object last summed (a cut list regrown: anew)

    def cumulative_logprob(self) -> float | None:
        lps = self.seq.logprobs
        if not lps:
            return None
        n = self.summed
        if lps is not self.summed_of or len(lps) < n or (n and lps[n - 1] is not self.summed_last):
            self.summed_of, self.summed, self.logprob_sum = lps, 0, 0.0  # replaced or cut: anew
        if self.summed < len(lps):
            self.logprob_sum = sum(lps[self.summed :], self.logprob_sum)
            self.summed, self.summed_last = len(lps), lps[-1]
        return self.logprob_sum

    def completion(self, visible_only: bool) -> tuple[CompletionOutput, str, list[int]]:
        """This sample's output, and the text and token ids new since the previous call.

        With `visible_only` (n > 1) an unfinished sample's text leaves out the characters held
        back for a stop string, so each completion's text only grows and can be streamed.
        """
        seq = self.seq
        finished = seq.is_finished
        visible = len(self.text) if finished else len(self.text) - self.stop_holdback
        visible = max(self.sent_text, visible)
        delta_text = self.text[self.sent_text : visible]
        self.sent_text = visible
        delta_ids = seq.output_token_ids[self.sent_tokens :]
        self.sent_tokens = len(seq.output_token_ids)
        # Only the new tokens' entries are built: rebuilding all would be quadratic.
        for i in range(len(self.logprobs), len(seq.logprobs)):
            tok = seq.output_token_ids[i]
            entry = {tok: seq.logprobs[i]}
            entry.update({t: v for t, v in seq.top_logprobs[i] if t != tok})
            self.logprobs.append(entry)
        asked = seq.params.logprobs is not None or seq.params.best_of
        completion = CompletionOutput(
            index=seq.index,
            text=self.text[: self.sent_text] if visible_only else self.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(self.logprobs) if asked and seq.logprobs else None,
            cumulative_logprob=self.cumulative_logprob(),
        )
        return completion, delta_text, delta_ids


@dataclass
class RequestState:
    """One request: its samples in index order (one unless n or best_of > 1)."""

    prompt: str | None
    samples: list[SampleState]
    n: int  # completions returned: the best n of the samples by cumulative logprob

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.samples)

    def output(self) -> RequestOutput | None:
        """The request's output now; None for best_of > n until it finishes (only the n best
        samples are returned, and which they are is known at the end)."""
        finished = self.finished
        ranked = len(self.samples) > self.n
        if ranked and not finished:
            return None
        many = len(self.samples) > 1
        done = [s.completion(visible_only=many) for s in self.samples]
        if ranked:  # best_of: the n with the highest cumulative logprob, renumbered
            done.sort(key=lambda d: -d[0].cumulative_logprob)
            done = done[: self.n]
            for i, (c, _, _) in enumerate(done):
                c.index = i
                if self.samples[0].seq.params.logprobs is None:
                    c.logprobs = None  # drawn only to rank the samples
        first, delta_text, delta_ids = done[0]
        if ranked:  # delivered once, whole
            delta_text, delta_ids = first.text, list(first.token_ids)
        seq = self.samples[0].seq
        scored = seq.prompt_logprobs if seq.prompt_scored else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[c for c, _, _ in done],
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            lora_name=seq.lora.lora_name if seq.lora else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            num_generated_tokens=sum(len(s.seq.output_token_ids) for s in self.samples),
            prompt_logprobs=scored,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_scheduled_time=seq.first_scheduled_time,
                first_token_time=min(
                    (t for s in self.samples if (t := s.seq.first_token_time) is not None),
                    default=None,
                ),
                last_token_time=max(
                    (t for s in self.samples if (t := s.seq.last_token_time) is not None),
                    default=None,
                ),
                finished_time=time.time() if finished else None,
                num_preemptions=sum(s.seq.num_preemptions for s in self.samples),
            ),  # fmt: skip
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def new_request(self, prompt: str | None, seqs: list[Sequence]) -> RequestState:
        p = seqs[0].params
        holdback = max((len(s) for s in p.stop or []), default=1) - 1
        samples = [
            SampleState(
                seq=seq,
                detok=self.tokenizer.detokenizer(
                    seq.prompt_token_ids, p.skip_special_tokens, p.kept_special_tokens
                ),
                stop_holdback=holdback,
            )
            for seq in seqs
        ]
        return RequestState(prompt=prompt, samples=samples, n=p.n)

    def check_stop(self, sample: SampleState) -> Stop | None:
        """Take in the sample's new tokens (more than one with speculation); whether the
        sample ends. Tokens after the one that ends it are dropped."""
        seq = sample.seq
        while sample.checked < len(seq.output_token_ids):
            sample.checked += 1
            stop = self._check_token(sample)
            if stop is not None:
                n = sample.checked
                del seq.output_token_ids[n:], seq.logprobs[n:], seq.top_logprobs[n:]
                return stop
        return None

    def _check_token(self, sample: SampleState) -> Stop | None:
        seq, p = sample.seq, sample.seq.params
        n_out = sample.checked
        token = seq.output_token_ids[n_out - 1]
        sample.text += sample.detok.push(token)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return Stop("stop", token)
            if token in self.eos_token_ids and not p.ignore_eos:
                return Stop("stop")
            if p.stop:
                window = sample.text[-(sample.stop_holdback + 64 + 1) * 2 :]
                base = len(sample.text) - len(window)
                hits = [(window.find(s), s) for s in p.stop if s in window]
                if hits:
                    at, s = min(hits)
                    end = base + at + (len(s) if p.include_stop_str_in_output else 0)
                    sample.text = sample.text[:end]
                    return Stop("stop", s)
            if any(proc.is_finished() for proc in seq.processors):
                return Stop("stop")
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return Stop("length")
        if len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            return Stop("length")
        return None

    @staticmethod
    def finished(sample: SampleState) -> None:
        """The sample ended: flush text the detokenizer held back (unless a stop string cut
        the text, which already ends where it should)."""
        seq = sample.seq
        if seq.finish_reason != "stop" or not isinstance(seq.stop_reason, str):
            sample.text += sample.detok.flush()
