"""Per-request logits processors: the sampler's hook for steering one request's next token.

A request asks for processors through its `SamplingParams` as data (`logit_bias`, and
`logits_processors`: a list of `{"kind": ..., ...}` specs), because in process mode the params
cross a pipe as JSON; the engine builds the processor objects on its side, once per request,
with the factory registered for each kind (`register`). A processor lives as long as its
request and keeps whatever state it needs (a grammar matcher, say).

Each step the sampler groups the rows that have processors by processor class and calls
`cls.apply_batch(logits, rows, processors)` once per class, so a class can do its whole batch
in a few tensor operations (one bitmask for every constrained row, one index_put for every
biased row). Order in the sampler: penalties → processors → min_tokens masking → argmax or
temperature/top-k/top-p/min-p sampling. Reported logprobs stay those of the raw model.

After the step's tokens are chosen the engine calls `accept(token)` on each of a request's
processors; `is_finished()` true ends the request with finish_reason "stop" (a grammar that
has matched its whole language, say). `fork()` copies the state for a sibling sample (n > 1);
`rollback(k)` undoes the last k accepted tokens (rejected speculative tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.engine.errors import BadRequestError
from loraplex.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessorContext:
    """What a factory may need to build a processor for one engine."""

    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    eos_token_ids: frozenset[int] = frozenset()
    tokenizer: Any = None  # loraplex.engine.models.tokenizer.Tokenizer
    cache: dict = field(default_factory=dict)  # shared across requests (compiled grammars)


class LogitsProcessor:
    """One request's processor. Subclasses override `apply` or, better, `apply_batch`."""

    @classmethod
    def apply_batch(
        cls,
        logits: torch.Tensor,  # [batch_rows, vocab] float32, changed in place
        rows: list[int],  # the rows of `logits` these processors own, one each
        processors: list[LogitsProcessor],  # all instances of `cls`
    ) -> None:
        for row, proc in zip(rows, processors, strict=True):
            proc.apply(logits[row])

    def apply(self, logits: torch.Tensor) -> None:  # [vocab], changed in place
        raise NotImplementedError

    def accept(self, token_id: int) -> None:
        """The token chosen for this request this step."""

    def is_finished(self) -> bool:
        return False

    def fork(self) -> LogitsProcessor:
        return copy.deepcopy(self)

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot undo accepted tokens")


Factory = Callable[[dict, ProcessorContext], LogitsProcessor]
_FACTORIES: dict[str, Factory] = {}


def register(kind: str) -> Callable[[Factory], Factory]:
    """Decorator: `factory(spec, ctx)` builds the processor for specs of this kind."""

    def wrap(factory: Factory) -> Factory:
        _FACTORIES[kind] = factory
        return factory

    return wrap


def build_processors(params: SamplingParams, ctx: ProcessorContext) -> list[LogitsProcessor]:
    """The processors a request asks for; ValueError (queuing nothing) for a bad spec."""
    procs: list[LogitsProcessor] = []
    if params.logit_bias:
        procs.append(LogitBias(params.logit_bias, ctx.vocab_size))
    for spec in params.logits_processors or []:
        kind = spec.get("kind") if isinstance(spec, dict) else None
        factory = _FACTORIES.get(kind)
        if factory is None:
            known = ", ".join(sorted(_FACTORIES)) or "none"
            raise ValueError(f"unknown logits processor kind {kind!r} (known: {known})")
        procs.append(factory(spec, ctx))
    return procs


def apply_processors(
    logits: torch.Tensor,  # [rows, vocab] float32, changed in place
    processors: list[list[LogitsProcessor]],  # per row, possibly empty
) -> None:
    """One `apply_batch` call per processor class over every row that has one."""
    groups: dict[type, tuple[list[int], list[LogitsProcessor]]] = {}
    for row, procs in enumerate(processors):
        for proc in procs:
            rows, objs = groups.setdefault(type(proc), ([], []))
            rows.append(row)
            objs.append(proc)
    for cls, (rows, objs) in groups.items():
        cls.apply_batch(logits, rows, objs)


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: token id -> bias added to its logit (clamped to [-100, 100])."""

    def __init__(self, bias: dict[int, float], vocab_size: int):
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(
                f"logit_bias names token ids outside this model's vocabulary [0, {vocab_size}): "
                f"{sorted(bad)[:5]}",
                param="logit_bias",
            )
        self.ids = list(bias)
        self.values = [max(-100.0, min(100.0, float(v))) for v in bias.values()]

    @classmethod
    def apply_batch(cls, logits, rows, processors) -> None:
        r = [row for row, p in zip(rows, processors, strict=True) for _ in p.ids]
        c = [t for p in processors for t in p.ids]
        v = [x for p in processors for x in p.values]
        dev = logits.device
        index = (torch.tensor(r, device=dev), torch.tensor(c, device=dev))
        logits.index_put_(index, torch.tensor(v, dtype=logits.dtype, device=dev), accumulate=True)

    def fork(self) -> LogitBias:
        return self  # stateless

    def rollback(self, num_tokens: int) -> None:
        return None  # stateless
