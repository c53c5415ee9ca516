"""What the inference routes call (platform/openai/chat.py, completions.py): the input's
verdict before the request is admitted, the output filter once its jobs exist. The Batch API
answers its lines through the same routes, so its lines are guarded the same way."""

from __future__ import annotations

import asyncio

from loraplex.platform.errors import APIError
from loraplex.platform.guardrails.gate import Gate
from loraplex.platform.guardrails.stream import OutputFilter


async def guard_input(state, caller, route: str, prompts: list, *, stream: bool, n: int,
                      logprobs) -> tuple[list, Gate | None]:  # fmt: skip
    """(the prompts as they may run, the request's gate or None without policies). A prompt
    given as token ids is judged as its text, and runs as the redacted text if redacted."""
    gate = await Gate.load(state, caller, route)
    if gate is None:
        return prompts, None
    if gate.has("output") and stream and n > 1:
        # A stream of several samples interleaves them: the filter holds back one sequence.
        raise APIError(400, "n > 1 cannot stream under the tenant's output guardrails; "
                       "set stream false or n 1", "unsupported_with_guardrails", "n")  # fmt: skip
    if gate.redacts_output() and logprobs not in (None, False):
        # The logprobs name the very tokens a redaction removes from the text.
        raise APIError(400, "logprobs cannot be returned under the tenant's output redaction "
                       "policy", "unsupported_with_guardrails", "logprobs")  # fmt: skip
    if not gate.has("input"):
        return prompts, gate
    tok = state.engine.tokenizer if state.engine is not None else None
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(await gate.input(p))
            continue
        text = tok.decode(p, skip_special_tokens=True) if tok is not None else ""
        judged = await gate.input(text)
        out.append(p if judged == text else judged)
    return out, gate


async def guard_output(gate: Gate | None, jobs: list, request_id: str) -> None:
    """Record the input's redactions and flags under the request's id; give each job the
    output filter where the tenant has output policies."""
    if gate is None:
        return
    await asyncio.to_thread(gate.started, request_id)
    if gate.has("output"):
        for job in jobs:
            job.output_filter = OutputFilter(gate, job)
