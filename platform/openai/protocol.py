"""OpenAI-compatible request bodies and their translation into engine SamplingParams."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraplex.engine import MAX_LOGPROBS, MAX_N, BadRequestError, SamplingParams, grammar_spec
from loraplex.platform.api.errors import APIError
from loraplex.platform.openai.structured import StructuredFields
from loraplex.platform.openai.tool_calls import (
    TOOL_MARKERS,
    Tool,
    ToolChoice,
    forced_calls_schema,
    resolve_choice,
)

# Request bodies are strict, as OpenAI's API is: a wrong JSON type ("max_tokens": "2") is a 400
# naming the field, never coerced, and an unknown field is a 400 too. Fields that OpenAI
# clients may send but that change nothing here are declared and documented as ignored
# (README, "API strictness"); they are the only exceptions.
_STRICT = ConfigDict(extra="forbid", strict=True)
# name -> why it changes nothing (docs/openai-compat.md is generated with these reasons).
IGNORED_FIELDS = {
    "metadata": "tags for stored completions; completions are never stored here",
    "store": "completions are never stored here",
    "service_tier": "one tier: every request is scheduled the same way",
    "prompt_cache_key": "the prefix cache is automatic, keyed by adapter and prompt tokens",
    "safety_identifier": "no abuse monitoring here; `user` names the end user in the usage ledger",
    "skip_special_tokens": "vLLM extension; special tokens are always left out of the text",
    "spaces_between_special_tokens": "vLLM extension; special tokens are never in the text",
}
# OpenAI parameters refused by name (400, code "unsupported", param the field): name -> why.
UNSUPPORTED_FIELDS = {
    "audio": "audio output needs an audio model; the served models write text",
    "modalities": "the served models write text only; leave modalities out",
    "functions": "deprecated by OpenAI; send tools",
    "function_call": "deprecated by OpenAI; send tool_choice",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the served models are not reasoning models",
    "verbosity": "the served models are not reasoning models",
    "web_search_options": "there is no web search here",
    "moderation": "there is no moderation model here",
    "prompt_cache_options": "the prefix cache is managed by the server",
    "prompt_cache_retention": "the prefix cache is managed by the server",
}
# vLLM's request extensions (its CompletionRequest / ChatCompletionRequest fields beyond
# OpenAI's) that change nothing here: name -> why. Those it honours are declared below.
VLLM_IGNORED_FIELDS = {
    "request_id": "the server names each request: the answer's id and its usage record's",
    "priority": "scheduling is fair share across tenants; a request's own priority is unused",
}
VLLM_IGNORED_CHAT_FIELDS = {
    "include_reasoning": "the served models do not reason: there is no reasoning to include",
}
# vLLM's extensions refused by name (400, code "unsupported"): name -> why.
_NO_REPETITION_STOP = "stopping on repeated token patterns is not implemented"
VLLM_UNSUPPORTED_FIELDS = {
    "use_beam_search": "beam search is not implemented; sample with n or best_of",
    "length_penalty": "a beam search parameter; beam search is not implemented",
    "allowed_token_ids": "not implemented; logit_bias can favour tokens",
    "prompt_embeds": "prompts are text or token ids",
    "logits_processors": "the server runs no code a request names",
    "return_tokens_as_token_ids": "not implemented; logprobs name tokens by their text",
    "return_token_ids": "not implemented; prompt_logprobs and logprobs show the tokens",
    "cache_salt": "the prefix cache cannot be salted per request",
    "kv_transfer_params": "there is no disaggregated prefill here",
    "vllm_xargs": "there are no custom extensions here",
    "max_repetition_pattern_size": _NO_REPETITION_STOP,
    "min_repetition_pattern_size": _NO_REPETITION_STOP,
    "repetition_min_count": _NO_REPETITION_STOP,
    "guided_whitespace_pattern": "JSON output follows the grammar's own whitespace",
}
VLLM_UNSUPPORTED_CHAT_FIELDS = {
    "echo": "not implemented for chat: the answer is the new message only",
    "add_generation_prompt": "the chat template is always asked for the assistant's turn",
    "continue_final_message": "not implemented; send the text to continue to /v1/completions",
    "add_special_tokens": "the chat template writes the special tokens",
    "documents": "there are no retrieval templates here",
    "chat_template": "the model's own chat template is used; a request cannot send one",
    "chat_template_kwargs": "the model's own chat template is used as it is",
    "mm_processor_kwargs": "the served models read text only",
    "bad_words": "not implemented; logit_bias can ban single tokens",
    "structural_tag": "not implemented; send tools or response_format",
}
# OpenAI's API takes 4 stop sequences, vLLM any number; evaluation harnesses written against
# vLLM send more than 4 (lm-eval's `until` strings plus the end-of-text string).
MAX_STOPS = 16
# Prompts in one /v1/completions request (each is its own engine request, started together).
MAX_PROMPTS = 256
# Message fields the openai client keeps when a previous answer is sent back in `messages`.
IGNORED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")


class StreamOptions(BaseModel):
    model_config = _STRICT
    # Left out: false, as OpenAI's; but with continuous_usage_stats, true, as vLLM's.
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: nothing here is obfuscated
    # vLLM's: usage as of each chunk in every chunk (load generators count tokens with it)
    continuous_usage_stats: bool = False


class _Common(StructuredFields):
    model_config = _STRICT
    # Accepted, and ignored with a reason / refused by name with a reason (see above).
    ignored_fields: ClassVar[dict[str, str]] = {**IGNORED_FIELDS, **VLLM_IGNORED_FIELDS}
    refused_fields: ClassVar[dict[str, str]] = {**UNSUPPORTED_FIELDS, **VLLM_UNSUPPORTED_FIELDS}

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    # token id (as a string: JSON keys are strings) -> bias, clamped to [-100, 100]
    logit_bias: dict[str, float] | None = None
    # Extensions in vLLM's style.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # vLLM's: per prompt position, the prompt token's logprob and this many alternatives
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the last this many
    request_id: str | None = Field(default=None, max_length=256)
    priority: int = 0
    # Accepted and ignored (see IGNORED_FIELDS).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        # A named 400 instead of pydantic's "Extra inputs are not permitted".
        if isinstance(data, dict):
            for name, why in cls.refused_fields.items():
                if name in data:
                    raise APIError(400, f"{name} is not supported: {why}", "unsupported", name)
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def check_supported(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                400,
                "prompt_logprobs cannot be used with stream (as in vLLM); send stream=false"
                + (", or echo with logprobs" if isinstance(self, CompletionRequest) else ""),
                "invalid_value",
                "prompt_logprobs",
            )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        self.check_supported()
        grammar = self.grammar()
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty or 1.0,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                n=self.n,
                best_of=getattr(self, "best_of", None),
                logit_bias=self.logit_bias,
                logits_processors=[grammar] if grammar else None,
                kept_special_tokens=self.kept_special_tokens(),
            )
        except BadRequestError as e:  # SamplingParams' checks name the field they are about
            raise APIError(400, str(e), "invalid_value", e.param) from None

    def kept_special_tokens(self) -> list[str] | None:
        """Special tokens the answer's text keeps (skip_special_tokens drops the rest)."""
        return None

    def truncated(self, prompt_ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last tokens only."""
        k = self.truncate_prompt_tokens
        return prompt_ids[-k:] if k else prompt_ids

    @property
    def include_usage(self) -> bool:
        o = self.stream_options
        return bool(o and (o.include_usage or (o.include_usage is None and self.continuous_usage)))

    @property
    def continuous_usage(self) -> bool:
        o = self.stream_options
        return bool(o and o.continuous_usage_stats and o.include_usage is not False)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: no completion, only the prompt (with echo and logprobs: the prompt's logprobs)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: false leaves out the BOS of a text prompt
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine must score: echo with logprobs shows the prompt's logprobs, the
        prompt_logprobs extension its own count (the larger serves both)."""
        asked = [self.prompt_logprobs]
        if self.echo:
            asked.append(self.logprobs)
        asked = [k for k in asked if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts sent: one (a string or token ids), or a list of either, each answered
        with its own n choices as OpenAI's API and vLLM do."""
        p = self.prompt
        many = isinstance(p, list) and bool(p) and isinstance(p[0], str | list)
        items = list(p) if many else [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "invalid_value", "prompt")
        if len(items) > MAX_PROMPTS:
            raise APIError(
                400, f"at most {MAX_PROMPTS} prompts per request; {len(items)} were sent",
                "invalid_value", "prompt",
            )  # fmt: skip
        for i, item in enumerate(items):
            if not item:
                raise APIError(400, f"prompt {i} is empty", "invalid_value", "prompt")
        return [x if isinstance(x, str) else list(x) for x in items]

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError(
                400,
                "max_tokens must be >= 1; 0 generates nothing and only serves to score the "
                "prompt: send it with echo (and logprobs) or prompt_logprobs",
                "invalid_value",
                "max_tokens",
            )
        if self.max_tokens == 0 and self.best_of not in (None, 1, self.n):
            raise APIError(
                400, "best_of needs max_tokens >= 1: it ranks what is generated",
                "invalid_value", "best_of",
            )  # fmt: skip
        if self.suffix:
            raise APIError(400, "suffix is not supported", "unsupported", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(
                400, f"best_of ({self.best_of}) must be >= n ({self.n})", "invalid_value", "best_of"
            )
        if self.best_of not in (None, 1) and self.stream:
            # As OpenAI: which samples are best is known only at the end.
            raise APIError(400, "best_of cannot be used with stream", "invalid_value", "best_of")


class ContentPart(BaseModel):
    # Other keys belong to part types (image_url, input_audio...) that text() refuses by name.
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class _CalledFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an earlier answer's calls (assistant)
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in IGNORED_MESSAGE_FIELDS}
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise APIError(
                    400,
                    f"content parts of type {part.type!r} are not supported",
                    "unsupported",
                    "messages",
                )
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a forced tool call is one call
    include_reasoning: bool | None = None  # vLLM's; ignored (see VLLM_IGNORED_CHAT_FIELDS)

    ignored_fields: ClassVar[dict[str, str]] = {**_Common.ignored_fields,
                                                **VLLM_IGNORED_CHAT_FIELDS}  # fmt: skip
    refused_fields: ClassVar[dict[str, str]] = {**_Common.refused_fields,
                                                **VLLM_UNSUPPORTED_CHAT_FIELDS}  # fmt: skip

    @property
    def tool_mode(self) -> str | None:
        """'auto', 'required', a function name, or None: see platform/openai/tool_calls.py."""
        return resolve_choice(self.tools, self.tool_choice)

    def kept_special_tokens(self) -> list[str] | None:
        # The tools parser reads the call markers; some tokenizers mark them special (Mistral's
        # `[TOOL_CALLS]`), and a dropped marker would turn a call into plain text.
        return list(TOOL_MARKERS) if self.tool_mode == "auto" else None

    def grammar(self) -> dict | None:
        spec = super().grammar()
        mode = self.tool_mode
        if mode in (None, "auto"):
            return spec
        if spec is not None:
            raise APIError(
                400,
                "a forced tool call (tool_choice) and an output constraint cannot be combined",
                "invalid_value",
                "tool_choice",
            )
        try:
            parallel = self.parallel_tool_calls is not False
            schema = forced_calls_schema(self.tools, mode, parallel)
            return grammar_spec("json_schema", schema)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", "invalid_value", "tools") from None

    def check_supported(self) -> None:
        super().check_supported()
        if self.n > 1 and self.tool_mode:
            raise APIError(400, "n > 1 cannot be combined with tools", "unsupported", "n")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                400, "top_logprobs requires logprobs=true", "invalid_value", "top_logprobs"
            )

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                msg["name"] = m.name
            out.append(msg)
        return out
