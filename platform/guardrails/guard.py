"""A guard adapter's verdict: P(unsafe) of a text, from one greedy token on the base.

The guard is a PEFT adapter trained to answer `GUARD_PROMPT` with " safe" or " unsafe" (the
generative form guard models such as Llama Guard use). Both answers' first tokens get a +100
logit bias, so the greedy token is whichever of the two the adapter prefers; with both in the
returned logprobs P(unsafe) is their softmax, else the chosen one decides (1.0 or 0.0). It
runs as an ordinary engine request (`engine.generate`), so the engine's scheduler batches it
with the traffic it guards, in the tenant's fair share.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass

from loraplex.engine import PRIORITY_INTERACTIVE, LoRARequest, SamplingParams
from loraplex.platform.db.models import ApiKey, Tenant
from loraplex.platform.serving import InferenceService
from loraplex.platform.state import Caller

GUARD_PROMPT = "{text}\nVerdict:"
SAFE, UNSAFE = " safe", " unsafe"
BIAS = 100.0  # the clamp of logit_bias: far above any logit gap between real tokens


class GuardFailed(Exception):
    """The guard could not give a verdict (adapter gone, engine error, bad tokens)."""


@dataclass(frozen=True)
class GuardSpec:
    adapter: str  # the adapter reference (name, name@alias or name@vN) of `owner`
    owner: Tenant  # the policy's tenant, or the operator's tenant that shares the guard
    threshold: float


def verdict_tokens(tok) -> tuple[int, int]:
    safe = tok.encode(SAFE, add_special_tokens=False)
    unsafe = tok.encode(UNSAFE, add_special_tokens=False)
    if not safe or not unsafe or safe[0] == unsafe[0]:
        raise GuardFailed("the tokenizer gives ' safe' and ' unsafe' the same first token")
    return safe[0], unsafe[0]


def guard_prompt_ids(tok, text: str, limit: int) -> list[int]:
    """The guard's prompt, its text cut from the left to fit `limit` tokens (the verdict
    follows the end of the prompt, so the newest text is what must stay)."""
    tail = tok.encode("\nVerdict:", add_special_tokens=False)
    body = tok.encode(text, add_special_tokens=True)
    keep = max(1, limit - len(tail))
    return body[-keep:] + tail


async def resolve_guard(state, spec: GuardSpec) -> LoRARequest:
    """The guard's engine adapter (looked up once per request: a lookup is a registry read and
    a last-used write); GuardFailed when it cannot be had."""
    service = InferenceService(state)
    owner = Caller(tenant=spec.owner, key=ApiKey(id=None))
    try:
        lora, _ = await asyncio.to_thread(service.resolve_model, owner, spec.adapter)
    except Exception as e:  # 404 (deleted), 503 (store down, engine loading): no verdict
        raise GuardFailed(f"guard adapter '{spec.adapter}' unavailable: {e}") from e
    if lora is None:
        raise GuardFailed("the base model is not a guard adapter")
    return lora


async def unsafe_probability(state, spec: GuardSpec, lora: LoRARequest, text: str) -> float:
    """P(unsafe) of `text` under the guard; GuardFailed when there is no verdict."""
    try:
        engine = InferenceService(state)._engine()  # its 503s: loading, stalled, stopping
    except Exception as e:
        raise GuardFailed(f"no engine for guard adapter '{spec.adapter}': {e}") from e
    tok = engine.tokenizer
    safe, unsafe = verdict_tokens(tok)
    ids = guard_prompt_ids(tok, text, engine.config.max_model_len - 1)
    params = SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=1, logit_bias={safe: BIAS, unsafe: BIAS}
    )
    return await _score(engine, ids, params, lora, spec, safe, unsafe)


async def _score(engine, ids, params, lora: LoRARequest, spec, safe: int, unsafe: int) -> float:
    last = None
    try:
        async for out in engine.generate(
            ids, params, lora, request_id=f"guard-{uuid.uuid4().hex}",
            tenant=str(spec.owner.id), weight=spec.owner.weight, priority=PRIORITY_INTERACTIVE,
        ):  # fmt: skip
            last = out
    except Exception as e:
        raise GuardFailed(f"guard adapter '{spec.adapter}' failed: {e}") from e
    if last is None or not last.outputs or not last.outputs[0].token_ids:
        raise GuardFailed(f"guard adapter '{spec.adapter}' gave no token")
    c = last.outputs[0]
    chosen = c.token_ids[0]
    lps = (c.logprobs or [{}])[0]
    if safe in lps and unsafe in lps and math.isfinite(lps[safe]) and math.isfinite(lps[unsafe]):
        return 1.0 / (1.0 + math.exp(lps[safe] - lps[unsafe]))
    return 1.0 if chosen == unsafe else 0.0
