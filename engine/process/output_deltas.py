"""Engine -> server messages of the engine process: per request, only what changed.

A step message carries, for each request the step advanced, the new token ids, the new text,
the new logprobs entries and the finish; the prompt goes once, with a request's first output,
and its prompt logprobs once, with the first output that has them (all positions scored).
So its size stays flat however long a generation runs (sending whole outputs made a long
generation cost O(n^2) bytes and JSON work on both sides). On the pipe each record is a JSON
array of its fields in declaration order, not an object: no key repeated per request per
step, and the C JSON encoder takes it whole, with no Python callback per dataclass
(benchmarks/serving_overhead.py measures both).

    engine process                                   server process
    RequestOutput ─ OutputEncoder ─ StepMessage (JSON) ─▶ OutputDecoder ─ RequestOutput
                    (how much went out)                   (the output so far)

The decoder rebuilds exactly the RequestOutput the engine returned, so callers cannot tell
the process mode from the in-process engine. Typed dataclasses, JSON: never pickle.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from loraplex.engine.outputs import (
    CompletionOutput,
    FinishReason,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)


@dataclass
class CompletionDelta:
    index: int
    token_ids: list[int]  # new since the previous message
    text_keep: int  # characters of the previous text kept: fewer when a stop string cut it
    text: str  # appended after them
    logprobs: list[dict[str, float]] | None  # new entries, {token id: logprob}, top first
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    cumulative_logprob: float | None


@dataclass
class RequestStart:
    """What stays the same over a request's outputs: sent with its first one."""

    prompt: str | None
    prompt_token_ids: list[int]
    lora_name: str | None


@dataclass
class OutputDelta:
    request_id: str
    finished: bool
    delta_text: str  # RequestOutput.delta_text (the text held back for stop strings differs)
    num_cached_tokens: int
    completions: list[CompletionDelta]
    start: RequestStart | None = None
    error: str | None = None
    num_generated_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # sent once
    metrics: RequestMetrics | None = None

    def row(self) -> list:
        return [
            self.request_id, self.finished, self.delta_text, self.num_cached_tokens,
            [_row(c) for c in self.completions],
            None if self.start is None else _row(self.start),
            self.error, self.num_generated_tokens,
            None if self.prompt_logprobs is None else _row(self.prompt_logprobs),
            None if self.metrics is None else _row(self.metrics),
        ]  # fmt: skip

    @classmethod
    def from_row(cls, r: list) -> OutputDelta:
        rid, finished, delta_text, cached, completions, start, error, generated, pl, m = r
        if pl is not None:  # JSON made the (token id, logprob) pairs lists
            token_logprobs, ranks, top = pl
            top = [None if t is None else [(i, v) for i, v in t] for t in top]
            pl = PromptLogprobs(token_logprobs, ranks, top)
        return cls(
            rid, finished, delta_text, cached,
            [CompletionDelta(*c) for c in completions],
            None if start is None else RequestStart(*start),
            error, generated, pl,
            None if m is None else RequestMetrics(*m),
        )  # fmt: skip


@dataclass
class RequestError:
    """An error a request caused (bad input, an adapter that cannot be loaded)."""

    request_id: str
    type: str  # the exception's class name (engine/errors.py BY_NAME)
    message: str
    param: str | None = None  # BadRequestError's request field


@dataclass
class StepMessage:
    outputs: list[OutputDelta] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: dict | None = None  # an EngineStats snapshot, now and then

    def to_json(self) -> bytes:
        msg = [[o.row() for o in self.outputs], [_row(e) for e in self.errors], self.stats]
        return json.dumps(msg, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StepMessage:
        outputs, errs, stats = json.loads(raw)
        return cls(
            outputs=[OutputDelta.from_row(o) for o in outputs],
            errors=[RequestError(*e) for e in errs],
            stats=stats,
        )


def _row(obj) -> list:
    """A flat dataclass's fields in declaration order: its constructor's positional order."""
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def _kept(old: str, new: str) -> int:
    """Length of the common prefix: all of `old` unless a stop string cut the text."""
    if new.startswith(old):
        return len(old)
    n = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        n += 1
    return n


@dataclass
class _Sent:
    tokens: int = 0
    text: str = ""
    logprobs: int = 0


class OutputEncoder:
    """Engine side: turns each RequestOutput into what changed since that request's last one.
    Relies on the engine's token ids and logprobs only growing (text may also be cut)."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_Sent]] = {}
        self._scored: set[str] = set()  # requests whose prompt logprobs went out

    def encode(self, out: RequestOutput) -> OutputDelta:
        sent = self._sent.get(out.request_id)
        start = None
        if sent is None:
            start = RequestStart(out.prompt, out.prompt_token_ids, out.lora_name)
            sent = self._sent[out.request_id] = []
        completions = []
        for i, c in enumerate(out.outputs):
            if i == len(sent):
                sent.append(_Sent())
            s = sent[i]
            keep = _kept(s.text, c.text)
            logprobs = None
            if c.logprobs is not None:
                logprobs = [{str(t): v for t, v in d.items()} for d in c.logprobs[s.logprobs :]]
            completions.append(
                CompletionDelta(
                    index=c.index,
                    token_ids=c.token_ids[s.tokens :],
                    text_keep=keep,
                    text=c.text[keep:],
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    cumulative_logprob=c.cumulative_logprob,
                )
            )
            s.tokens, s.text = len(c.token_ids), c.text
            s.logprobs = 0 if c.logprobs is None else len(c.logprobs)
        # The decoder rebuilds delta_token_ids from the first completion's new ids.
        assert not completions or completions[0].token_ids == out.delta_token_ids
        prompt_logprobs = None
        if out.prompt_logprobs is not None and out.request_id not in self._scored:
            prompt_logprobs = out.prompt_logprobs
            self._scored.add(out.request_id)
        if out.finished:
            del self._sent[out.request_id]
            self._scored.discard(out.request_id)
        return OutputDelta(
            request_id=out.request_id,
            finished=out.finished,
            delta_text=out.delta_text,
            num_cached_tokens=out.num_cached_tokens,
            completions=completions,
            start=start,
            error=out.error,
            num_generated_tokens=out.num_generated_tokens,
            metrics=out.metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._scored.discard(request_id)


@dataclass
class _Output:
    start: RequestStart
    token_ids: list[list[int]] = field(default_factory=list)  # per completion
    text: list[str] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


class OutputDecoder:
    """Server side: the output so far of each running request, rebuilt from its deltas."""

    def __init__(self) -> None:
        self._outputs: dict[str, _Output] = {}

    def decode(self, d: OutputDelta) -> RequestOutput:
        acc = self._outputs.get(d.request_id)
        if acc is None:
            assert d.start is not None, f"request {d.request_id}: first output without its start"
            acc = self._outputs[d.request_id] = _Output(d.start)
        if d.prompt_logprobs is not None:
            acc.prompt_logprobs = d.prompt_logprobs
        completions = []
        for i, c in enumerate(d.completions):
            if i == len(acc.token_ids):
                acc.token_ids.append([])
                acc.text.append("")
                acc.logprobs.append(None)
            acc.token_ids[i] += c.token_ids
            acc.text[i] = acc.text[i][: c.text_keep] + c.text
            if c.logprobs is not None:
                if acc.logprobs[i] is None:
                    acc.logprobs[i] = []
                acc.logprobs[i] += [{int(t): v for t, v in e.items()} for e in c.logprobs]
            logprobs = acc.logprobs[i]
            completions.append(
                CompletionOutput(
                    index=c.index,
                    text=acc.text[i],
                    token_ids=list(acc.token_ids[i]),  # a copy: callers may read it later
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=None if logprobs is None else list(logprobs),
                    cumulative_logprob=c.cumulative_logprob,
                )
            )
        if d.finished:
            del self._outputs[d.request_id]
        return RequestOutput(
            request_id=d.request_id,
            prompt=acc.start.prompt,
            prompt_token_ids=acc.start.prompt_token_ids,
            outputs=completions,
            finished=d.finished,
            num_cached_tokens=d.num_cached_tokens,
            lora_name=acc.start.lora_name,
            delta_text=d.delta_text,
            delta_token_ids=list(d.completions[0].token_ids) if d.completions else [],
            error=d.error,
            num_generated_tokens=d.num_generated_tokens,
            prompt_logprobs=acc.prompt_logprobs,
            metrics=d.metrics,
        )

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
