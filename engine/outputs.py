"""What generation returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, top first
    cumulative_logprob: float | None = None


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
