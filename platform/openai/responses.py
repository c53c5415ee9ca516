"""What the OpenAI routes answer: the whole answers (`Completion`, `ChatCompletion`), the
streamed chunks (`CompletionChunk`, `ChatCompletionChunk`), usage, logprobs and tool calls.

A field declared `X | MISSING = MISSING` is left out of the JSON unless it was given: OpenAI's
API (and vLLM's extensions) send some fields only in some answers (`usage` on a chunk only with
`stream_options`, `tool_calls` only when there are calls), while others go out as an explicit
null (`logprobs`, `finish_reason`). Fields are declared in the order they are written today, so
an answer's JSON keeps its bytes; where two kinds of answer order the same keys differently
(a streamed choice writes `logprobs` before `finish_reason`, a whole one after) they are two
models, as in OpenAI's own types.
"""

from __future__ import annotations

from typing import Literal

from pydantic import MISSING, BaseModel


class _Answer(BaseModel):
    """Built by the server only, from values it made: nothing to coerce."""


# ----------------------------------------------------------------------------- usage
class PromptTokensDetails(_Answer):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Left out of vLLM's continuous usage (`stream_options.continuous_usage_stats`).
    prompt_tokens_details: PromptTokensDetails | MISSING = MISSING


# -------------------------------------------------------------------------- logprobs
class CompletionLogprobs(_Answer):
    """The legacy completions `logprobs` object (platform/openai/logprobs.py)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Answer):
    """vLLM's: one token of a prompt position's `prompt_logprobs` entry."""

    logprob: float
    rank: int
    decoded_token: str


# per prompt position: None for the first, else {token id: its logprob and rank}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Answer):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob]


# ------------------------------------------------------------------------ tool calls
class CalledFunction(_Answer):
    name: str
    arguments: str  # JSON text


class ChatToolCall(_Answer):
    """A call in a whole answer's message."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(_Answer):
    name: str | MISSING = MISSING  # in a call's first delta only
    arguments: str


class ToolCallDelta(_Answer):
    """One entry of a streamed `delta.tool_calls`: a call's first delta has its id, type and
    name; the next ones add to its arguments."""

    index: int
    id: str | MISSING = MISSING
    type: Literal["function"] | MISSING = MISSING
    function: FunctionDelta


# ----------------------------------------------------------------------- completions
class CompletionChoice(_Answer):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None | MISSING = MISSING  # vLLM's, when asked


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionChunk(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | MISSING = MISSING


# ------------------------------------------------------------------------------ chat
class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ChatToolCall] | MISSING = MISSING


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None | MISSING = MISSING  # vLLM's, when asked


class ChoiceDelta(_Answer):
    """A streamed choice's new content or calls; the role comes with its first delta."""

    content: str | None | MISSING = MISSING
    tool_calls: list[ToolCallDelta] | MISSING = MISSING
    role: Literal["assistant"] | MISSING = MISSING


class SampleDelta(_Answer):
    """A delta of one of n > 1 streamed choices (the role first, in its first delta)."""

    role: Literal["assistant"] | MISSING = MISSING
    content: str


class ChatChunkChoice(_Answer):
    index: int
    delta: ChoiceDelta | SampleDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Answer):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | MISSING = MISSING


# ---------------------------------------------------------------------------- models
class ModelPermission(_Answer):
    """vLLM's `ModelPermission`, which clients written against it may read."""

    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: str | None
    is_blocking: bool


class MixtureOfExperts(_Answer):
    num_experts: int
    experts_per_token: int


class Architecture(_Answer):
    """Our extension: what the base model is, so what an adapter must have been trained on."""

    family: str
    mixture_of_experts: MixtureOfExperts | None  # null for a dense model


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None
    permission: list[ModelPermission]
    architecture: Architecture | None  # null while the model loads


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]
