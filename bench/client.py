"""One streamed OpenAI completion, timed chunk by chunk.

The request is `/v1/completions` with the prompt as token ids (so every server sees exactly the
trace's input length), greedy, `ignore_eos` (so it sees exactly the output length; a vLLM
extension that loraplex accepts too), `stream` with `stream_options.include_usage` (so the
token count is the server's own, not a count of chunks).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

import httpx

from loraplex.bench.metrics import RequestResult
from loraplex.bench.trace import TraceRequest

Clock = Callable[[], float]


def completion_body(req: TraceRequest, model: str, ignore_eos: bool = True) -> dict:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _carries_tokens(choice: dict) -> bool:
    """A chunk's choice carries output unless it is only the closing finish_reason."""
    text = choice.get("text")
    if text is None:  # chat-style chunk
        text = (choice.get("delta") or {}).get("content")
    return bool(text) or choice.get("finish_reason") is None


async def consume_sse(lines: AsyncIterator[str], result: RequestResult, clock: Clock) -> None:
    """Read server-sent events into `result` (changed in place): token times, usage, errors."""
    chunks = 0
    usage = None
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        now = clock()
        obj = json.loads(data)
        if obj.get("error"):
            err = obj["error"]
            result.error = (
                f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            )
            result.end_s = now
            return
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
            if _carries_tokens(choice):
                if result.first_token_s is None:
                    result.first_token_s = now
                result.token_times.append(now)
                chunks += 1
        usage = obj.get("usage") or usage
    result.end_s = clock()
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.usage_prompt_tokens = usage.get("prompt_tokens")
    else:
        result.output_tokens = chunks
    if result.first_token_s is None and result.error is None:
        result.error = "empty stream: no tokens"


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    api_key: str | None,
    model: str,
    req: TraceRequest,
    *,
    t0: float,
    ignore_eos: bool = True,
) -> RequestResult:
    """Send `req` to `url` (…/v1/completions); times are seconds after `t0` (perf_counter)."""

    def clock() -> float:
        return time.perf_counter() - t0

    result = RequestResult.sent(req, clock())
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with client.stream(
            "POST", url, json=completion_body(req, model, ignore_eos), headers=headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    message = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = body[:200]
                result.error = f"http {resp.status_code}: {message}"
                result.end_s = clock()
                return result
            await consume_sse(resp.aiter_lines(), result, clock)
    except (httpx.HTTPError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.end_s = clock()
    return result
