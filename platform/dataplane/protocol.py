"""vLLM's HTTP API as the data plane speaks it: the engine's SamplingParams as a streamed
/v1/completions request, its chunks back as the engine's RequestOutputs, its errors as the
engine's error types, and the few /metrics gauges the platform reads."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import httpx

from loraplex.engine import BadRequestError, CompletionOutput, RequestOutput, SamplingParams
from loraplex.platform.dataplane.errors import DataPlaneUnavailable, Unsupported

# vLLM's priority scheduling: lower is served first. Batch lines go after interactive work.
VLLM_PRIORITY = {0: 0, 1: 10}


def request_body(model: str, prompt: list[int], params: SamplingParams, priority: int) -> dict:
    """vLLM's completions request for the engine's SamplingParams; what vLLM cannot do as
    the engine does is refused by name."""
    if params.best_of is not None and params.best_of != params.n:
        raise Unsupported("best_of", "best_of")
    if params.logprobs is not None:
        raise Unsupported("logprobs", "logprobs")
    if params.prompt_logprobs is not None:
        raise Unsupported("prompt_logprobs", "prompt_logprobs")
    if params.logits_processors:
        raise Unsupported("structured output (response_format, guided decoding)", "response_format")
    body: dict = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "return_token_ids": True,
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": [params.stop] if isinstance(params.stop, str) else (params.stop or []),
        "stop_token_ids": params.stop_token_ids or [],
        "ignore_eos": params.ignore_eos,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        # Tool-call markers the platform parses are special tokens in some tokenizers.
        "skip_special_tokens": params.skip_special_tokens and not params.kept_special_tokens,
    }
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if priority:
        body["priority"] = VLLM_PRIORITY.get(priority, priority)
    return body


class Assembler:
    """vLLM's stream chunks → the engine's cumulative RequestOutputs with deltas."""

    def __init__(self, request_id: str, prompt: list[int], n: int, lora_name: str | None):
        self.out = RequestOutput(request_id, None, prompt, [], False, lora_name=lora_name)
        self.choices: dict[int, CompletionOutput] = {}
        self.n = n

    def add(self, chunk: dict) -> RequestOutput | None:
        if "error" in chunk:  # vLLM failed the request mid-stream
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise DataPlaneUnavailable(f"vLLM failed the request: {message}")
        usage = chunk.get("usage") or {}
        choices = chunk.get("choices") or []
        if not choices:
            return None
        text, ids = [], []
        for c in choices:
            i = c.get("index", 0)
            mine = self.choices.get(i)
            if mine is None:
                mine = self.choices[i] = CompletionOutput(i, "", [])
            new_ids = c.get("token_ids") or []
            mine.text += c.get("text") or ""
            mine.token_ids = mine.token_ids + new_ids
            if c.get("finish_reason") is not None:
                mine.finish_reason = c["finish_reason"]
                mine.stop_reason = c.get("stop_reason")
            text.append(c.get("text") or "")
            ids.extend(new_ids)
        o = self.out
        # Copies: an output handed out must not change while its reader works on it (the
        # lists are rebound, never extended, so a shallow copy is a snapshot).
        o.outputs = [replace(self.choices[i]) for i in sorted(self.choices)]
        o.delta_text, o.delta_token_ids = "".join(text), ids
        o.num_generated_tokens = usage.get("completion_tokens") or sum(
            len(c.token_ids) for c in o.outputs
        )
        details = usage.get("prompt_tokens_details") or {}
        o.num_cached_tokens = details.get("cached_tokens") or o.num_cached_tokens
        done = [c for c in o.outputs if c.finish_reason is not None]
        o.finished = len(done) >= self.n
        # A new object per step: the platform may hold one while the next arrives.
        return RequestOutput(**{k: getattr(o, k) for k in o.__dataclass_fields__})


def http_error(r: httpx.Response, e) -> Exception:
    try:
        error = r.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except ValueError:
        message = r.text[:500]
    if r.status_code in (400, 422):
        return BadRequestError(f"the vLLM data plane refused the request: {message}")
    if r.status_code == 404:  # the adapter is gone from vLLM (restart): the next poll sees it
        e.loaded.clear()
        return DataPlaneUnavailable(f"vLLM at {e.url} does not have the adapter now: {message}")
    return DataPlaneUnavailable(f"vLLM at {e.url} answered {r.status_code}: {message}")


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (all label sets) in an exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total
