"""vLLM's HTTP API as the data plane speaks it: the engine's SamplingParams as a streamed
/v1/completions request, its chunks back as the engine's RequestOutputs, its errors as the
engine's error types, and the few /metrics gauges the platform reads.

What vLLM does as the engine does goes through: logprobs (named by token id,
`return_tokens_as_token_ids`), prompt logprobs (vLLM scores them only without `stream`: such a
request is sent whole and answered at its end), structured output (the engine's grammar specs
as vLLM's `structured_outputs`, the same xgrammar grammars), the tenant's prefix-cache salt
(`cache_salt`: vLLM's prefix cache is separated per tenant as the engine's is). The rest
(`best_of` other than `n`: vLLM 0.32 has none) is refused by name."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

from loraplex.engine import (
    BadRequestError,
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    SamplingParams,
)
from loraplex.platform.dataplane.errors import DataPlaneUnavailable, Unsupported

# vLLM's priority scheduling: lower is served first. Batch lines go after interactive work.
VLLM_PRIORITY = {0: 0, 1: 10}
# What a vLLM behind the platform runs with beyond --enable-lora and the priority policy:
# structured output by xgrammar (the engine's library) writing JSON without free whitespace,
# as the engine does. vLLM 0.32 reads the whitespace choice only from its server config (a
# request's `disable_any_whitespace` is ignored); without it a JSON answer may differ.
VLLM_SERVER_FLAGS = (
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)


def request_body(model: str, prompt: list[int], params: SamplingParams, priority: int) -> dict:
    """vLLM's completions request for the engine's SamplingParams; what vLLM cannot do as
    the engine does is refused by name."""
    if params.best_of is not None and params.best_of != params.n:
        raise Unsupported("best_of", "best_of")
    if params.n > 1 and params.greedy:  # vLLM refuses it (the engine returns n equal copies)
        raise Unsupported("n > 1 with greedy sampling (temperature 0)", "n")
    # vLLM refuses prompt_logprobs on a stream: that request goes whole (`stream` false).
    stream = params.prompt_logprobs is None
    body: dict = {
        "model": model,
        "prompt": prompt,
        "stream": stream,
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
        # 0 (score the prompt only): vLLM generates at least one, which the Assembler drops.
        "max_tokens": None if params.max_tokens is None else (params.max_tokens or 1),
        "min_tokens": params.min_tokens,
        "stop": [params.stop] if isinstance(params.stop, str) else (params.stop or []),
        "stop_token_ids": params.stop_token_ids or [],
        "ignore_eos": params.ignore_eos,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        # Tool-call markers the platform parses are special tokens in some tokenizers.
        "skip_special_tokens": params.skip_special_tokens and not params.kept_special_tokens,
    }
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.logprobs is not None or params.prompt_logprobs is not None:
        body["return_tokens_as_token_ids"] = True  # token ids, never ambiguous text
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = params.prompt_logprobs
    if params.logits_processors:
        body["structured_outputs"] = structured_outputs(params.logits_processors)
    if params.cache_salt:  # the tenant's (platform/serving.py); null until first rotated
        body["cache_salt"] = params.cache_salt
    if priority:
        body["priority"] = VLLM_PRIORITY.get(priority, priority)
    return body


def structured_outputs(specs: list[dict]) -> dict:
    """The engine's grammar spec (engine/sampling/structured_output.py) as vLLM's
    `structured_outputs`: the same grammar, compiled by vLLM's xgrammar (JSON without free
    whitespace where vLLM runs with VLLM_SERVER_FLAGS)."""
    grammars = [s for s in specs if isinstance(s, dict) and s.get("kind") == "grammar"]
    if len(grammars) != len(specs) or len(grammars) != 1:
        raise Unsupported("logits processors other than one grammar", "response_format")
    kind, value = grammars[0].get("type"), grammars[0].get("value")
    if kind == "json_schema":
        return {"json": value}
    if kind == "json_object":  # the engine's: any JSON object (vLLM's own allows any value)
        return {"json": {"type": "object"}}
    if kind == "regex":
        return {"regex": value}
    if kind == "choice":
        return {"choice": value}
    if kind == "ebnf":
        return {"grammar": value}
    raise Unsupported(f"a {kind!r} grammar", "response_format")


def token_id(token: str) -> int:
    """vLLM's `token_id:123` (return_tokens_as_token_ids) as 123."""
    return int(token.rsplit(":", 1)[1])


def generated_logprobs(lp: dict) -> list[dict[int, float]]:
    """vLLM's legacy `logprobs` piece as the engine's entries: per token {id: logprob}, the
    chosen token first, then the alternatives best first."""
    out = []
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                strict=True):  # fmt: skip
        t = token_id(tok)
        entry = {t: chosen}
        alts = sorted(((token_id(k), v) for k, v in (top or {}).items()), key=lambda kv: -kv[1])
        entry.update((k, v) for k, v in alts if k != t)
        out.append(entry)
    return out


def prompt_logprobs(prompt: list[int], scored: list[dict | None], k: int) -> PromptLogprobs:
    """vLLM's per position {token id: {logprob, rank}} as the engine's PromptLogprobs."""
    out = PromptLogprobs([], [], [])
    for i, at in enumerate(scored):
        if at is None:  # position 0: no context
            lp, rank, top = None, None, None
        else:
            lp, rank = at[str(prompt[i])]["logprob"], at[str(prompt[i])]["rank"]
            ranked = sorted((v["rank"], int(t), v["logprob"]) for t, v in at.items())
            top = [(t, v) for r, t, v in ranked if r <= k][:k]
        out.token_logprobs.append(lp)
        out.ranks.append(rank)
        out.top.append(top)
    return out


class Assembler:
    """vLLM's stream chunks → the engine's cumulative RequestOutputs with deltas."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 lora_name: str | None):  # fmt: skip
        self.out = RequestOutput(request_id, None, prompt, [], False, lora_name=lora_name)
        self.choices: dict[int, CompletionOutput] = {}
        self.n = params.n
        self.logprobs = params.logprobs is not None
        self.prompt_logprobs = params.prompt_logprobs
        self.nothing = params.max_tokens == 0  # vLLM made one token nobody asked for
        self.made: dict[int, int] = {}  # choice -> tokens vLLM counts for it

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
            new_ids, new_text = c.get("token_ids") or [], c.get("text") or ""
            if self.nothing:
                new_ids, new_text = [], ""
            mine.text += new_text
            mine.token_ids = mine.token_ids + new_ids
            if self.logprobs and c.get("logprobs") and new_ids:
                entries = generated_logprobs(c["logprobs"])
                mine.logprobs = (mine.logprobs or []) + entries
                chosen = sum(next(iter(e.values())) for e in entries)  # each entry's first
                mine.cumulative_logprob = (mine.cumulative_logprob or 0.0) + chosen
            if c.get("finish_reason") is not None:
                mine.finish_reason = "length" if self.nothing else c["finish_reason"]
                mine.stop_reason = None if self.nothing else c.get("stop_reason")
            if self.prompt_logprobs is not None and c.get("prompt_logprobs") is not None:
                self.out.prompt_logprobs = prompt_logprobs(
                    self.out.prompt_token_ids, c["prompt_logprobs"], self.prompt_logprobs
                )
            text.append(new_text)
            ids.extend(new_ids)
        o = self.out
        # Copies: an output handed out must not change while its reader works on it (the
        # lists are rebound, never extended, so a shallow copy is a snapshot).
        o.outputs = [replace(self.choices[i]) for i in sorted(self.choices)]
        o.delta_text, o.delta_token_ids = "".join(text), ids
        # A streamed chunk carries one choice and that choice's count (continuous usage is
        # per choice with n > 1); a whole answer carries them all and the total.
        if "completion_tokens" in usage and not self.nothing:
            if len(choices) == 1:
                self.made[choices[0].get("index", 0)] = usage["completion_tokens"]
            else:
                self.made = {-1: usage["completion_tokens"]}
        o.num_generated_tokens = sum(self.made.values()) or sum(len(c.token_ids) for c in o.outputs)
        details = usage.get("prompt_tokens_details") or {}
        o.num_cached_tokens = details.get("cached_tokens") or o.num_cached_tokens
        done = [c for c in o.outputs if c.finish_reason is not None]
        o.finished = len(done) >= self.n
        # A new object per step: the platform may hold one while the next arrives.
        return RequestOutput(**{k: getattr(o, k) for k in o.__dataclass_fields__})


def http_error(status: int, text: str, e) -> Exception:
    """vLLM's error answer as the engine's error types."""
    param = None
    try:
        error = json.loads(text).get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
        param = error.get("param") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = text[:500]
    if status in (400, 422):
        return BadRequestError(f"the vLLM data plane refused the request: {message}", param)
    if status == 404:  # the adapter is gone from vLLM (restart): the next poll sees it
        e.loaded.clear()
        return DataPlaneUnavailable(f"vLLM at {e.url} does not have the adapter now: {message}")
    return DataPlaneUnavailable(f"vLLM at {e.url} answered {status}: {message}")


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (all label sets) in an exposition."""
    return metrics_of(text, (name,))[name]


def metrics_of(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sums of several metrics' samples (`name{labels} value` or `name value` lines).
    vLLM's exposition runs to thousands of lines (histograms per adapter) and is read every
    second: each name is looked for with `str.find`, not by a Python loop over the lines."""
    totals = dict.fromkeys(names, 0.0)
    text = "\n" + text
    for name in totals:
        key = "\n" + name
        at = text.find(key)
        while at >= 0:
            end = text.find("\n", at + 1)
            line = text[at + len(key) : end if end >= 0 else None]
            if line[:1] in ("{", " "):
                with contextlib.suppress(ValueError, IndexError):
                    totals[name] += float(line.rpartition("}")[2].split()[0])
            at = text.find(key, at + 1)
    return totals
