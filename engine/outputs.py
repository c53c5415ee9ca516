"""What generation returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Why a sequence ended: a stop string/token or EOS, max_tokens (or the context), the caller
# aborted it (client gone, stream cut), or the engine failed it (`RequestOutput.error`).
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, top first
    cumulative_logprob: float | None = None


@dataclass
class PromptLogprobs:
    """Per prompt position i: log p(prompt[i] | prompt[:i]) in float32 from the raw logits
    (as completion logprobs), that token's rank (1: the most likely) and the `prompt_logprobs`
    most likely tokens there. Position 0 has no context: None, as in OpenAI's and vLLM's."""

    token_logprobs: list[float | None] = field(default_factory=lambda: [None])
    ranks: list[int | None] = field(default_factory=lambda: [None])
    top: list[list[tuple[int, float]] | None] = field(default_factory=lambda: [None])

    def __len__(self) -> int:  # positions scored so far (position 0 included)
        return len(self.token_logprobs)


@dataclass
class RequestMetrics:
    """When a request passed each stage, as vLLM's `RequestMetrics` names them: wall-clock
    seconds (time.time()), None until it happens; and how often it was preempted.

    A request with an adapter also says where the engine held that adapter when the request
    arrived (`adapter_tier`: "device" a slot, "host" host memory, "disk" to be read) and, once
    its first step has the adapter in a slot, how long the request waited for that
    (`adapter_load_time`, seconds: the read from disk until the engine took it into host
    memory, plus the slot write when its step made one; 0.0 when neither was needed)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    adapter_tier: str | None = None
    adapter_load_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    lora_name: str | None = None
    # Since this request's previous output (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # tokens generated for the request, every sample (best_of also draws ones not returned)
    num_generated_tokens: int = 0
    # SamplingParams.prompt_logprobs: set once every prompt position is scored
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
