"""A request as the scheduler sees it: tokens, progress and its KV blocks."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from loraplex.engine.outputs import FinishReason, PromptLogprobs
from loraplex.engine.sampling_params import SamplingParams

PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 1  # Batch API lines: idle capacity only


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter in vLLM's style; `lora_int_id` must be unique per adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError("lora_int_id must be >= 1 (0 means no adapter)")


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generation request.

    Progress is `num_computed_tokens` against `num_tokens` (prompt + output), so a prefill
    chunk, a decode and a recompute after preemption are the same operation: compute the
    tokens not yet in the KV cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    tenant: str | None = None
    weight: float = 1.0  # the tenant's fair-share weight (service is charged / weight)
    # The request's class, most urgent first: a class is admitted only into capacity the more
    # urgent ones leave free, and preempted before them (engine/scheduling/scheduler.py).
    priority: int = PRIORITY_INTERACTIVE
    arrival: float = 0.0
    # wall-clock stage times and preemptions (RequestOutput.metrics)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None  # made on the logits' device at first sample
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    seq_no: int = field(default_factory=lambda: next(_ids))
    # built by the engine from params (engine/sampling/logits_processors.py); live only in the
    # engine
    processors: list = field(default_factory=list)
    # n > 1: the request's other samples, forked from this one when its prompt is computed
    # (they share its prompt's KV blocks and sample from the same logits at that step)
    fork_children: list[Sequence] = field(default_factory=list)
    index: int = 0  # which completion of its request this is
    seed: int | None = None  # this sample's seed (params.seed for index 0, derived for others)
    # speculative decoding: tokens proposed for this step (scored with the real next token)
    spec_tokens: list[int] = field(default_factory=list)
    spec_proposed: int = 0  # proposals scored over the request's life
    spec_accepted: int = 0
    # params.prompt_logprobs: filled as the prompt's rows are computed (the first sample only)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def adapter_id(self) -> int:
        return self.lora.lora_int_id if self.lora else 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_scored(self) -> bool:
        """Whether every prompt position's logprobs are in (True when none were asked)."""
        pl = self.prompt_logprobs
        return pl is None or len(pl) >= len(self.prompt_token_ids)

    @property
    def max_cached_tokens(self) -> int:
        """Most leading tokens the prefix cache may serve: one is left to compute for the
        logits to sample from, and a prompt still being scored needs every row not yet
        scored (row p gives position p + 1's logprobs)."""
        if not self.prompt_scored:
            return len(self.prompt_logprobs) - 1
        return self.num_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole prompt + output list."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
