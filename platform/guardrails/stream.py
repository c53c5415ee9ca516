r"""The output filter: the engine's outputs of one request as the client may see them.

Text is released to the route only once it has been judged: the filter keeps the newest
`HOLDBACK` characters back (so a term or pattern up to that long is caught before any of it
is sent), and judges the window (the last `CONTEXT` characters already sent + all held text)
every `STRIDE` new characters and at the end, but never while all it holds is `HOLDBACK`
characters or fewer: such a judgement could release nothing (the first comes with the first
token past `HOLDBACK`, the earliest any text may leave). A block ends the request there:
the text before the hit goes out, then `finish_reason: "content_filter"`, and the engine
request is aborted. A redaction replaces the held span. The route bills the tokens of the
text it was given (`delta_token_ids`, `num_generated_tokens`), so a cut stream is billed
exactly what was sent, streamed or not.

```
 sent ..........|<---------- held ---------->|
      <-CONTEXT->                             new output
      \________ judged window _____________________/
```
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from loraplex.engine import RequestOutput
from loraplex.platform.guardrails.checks import redact
from loraplex.platform.guardrails.gate import CONTENT_FILTER, Gate

HOLDBACK = 32  # characters held back: the longest term/pattern match caught before sending
STRIDE = 16  # new characters between two judgements (each may run the guard adapter)
CONTEXT = 160  # characters already sent that the window keeps (the guard's context)


class OutputFilter:
    def __init__(self, gate: Gate, job) -> None:
        self.gate, self.job = gate, job
        self.held: list[tuple[str, list[int]]] = []  # (text, token ids) not yet released
        self.sent_text = ""
        self.sent_ids: list[int] = []
        self.unjudged = 0  # characters held since the last judgement
        self.judged_to = 0  # characters (sent + held) the last judgement saw

    async def __call__(self, raw: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for out in raw:
                if len(out.outputs) != 1:  # n > 1, not streamed (Gate refuses that stream)
                    yield await self._whole(out) if out.finished else out
                    continue
                out = await self._step(out)
                yield out
                if out.finished:
                    return
        finally:
            await raw.aclose()  # a cut aborts the engine request

    async def _step(self, out: RequestOutput) -> RequestOutput:
        self.held.append((out.delta_text, list(out.delta_token_ids)))
        self.unjudged += len(out.delta_text)
        held = "".join(t for t, _ in self.held)
        if not out.finished and (self.unjudged < STRIDE or len(held) <= HOLDBACK):
            return self._emit(out, [], finished=False)  # nothing judged, nothing to release
        self.unjudged = 0
        context = self.sent_text[-CONTEXT:]
        origin = len(self.sent_text) - len(context)  # the window's first character, overall
        v = await self.gate.evaluate(
            "output", context + held, start=len(context), new_from=self.judged_to - origin
        )
        if v.events:
            await self.gate.record(self.job.request_id, v.events)
        if v.block:
            cut, at, pieces = v.cut - len(context), 0, []
            for text, ids in self.held:  # whole tokens before the hit
                if at + len(text) > cut:
                    break
                pieces.append((text, ids))
                at += len(text)
            while pieces and not pieces[-1][0]:  # a token with no text yet: part of the hit
                pieces.pop()
            self.held = []
            self.job.finish_reason = CONTENT_FILTER
            return self._emit(out, pieces, finished=True, reason=CONTENT_FILTER)
        if v.spans:
            spans = [(s - len(context), e - len(context)) for s, e in v.spans]
            self.held = [(redact(held, spans), [i for _, ids in self.held for i in ids])]
        self.judged_to = len(self.sent_text) + sum(len(t) for t, _ in self.held)
        if out.finished:
            pieces, self.held = self.held, []
            return self._emit(out, pieces, finished=True)
        pieces, left = [], sum(len(t) for t, _ in self.held)
        while self.held and left - len(self.held[0][0]) >= HOLDBACK:
            left -= len(self.held[0][0])
            pieces.append(self.held.pop(0))
        return self._emit(out, pieces, finished=False)

    def _emit(self, out: RequestOutput, pieces, *, finished: bool,
              reason: str | None = None) -> RequestOutput:  # fmt: skip
        text = "".join(t for t, _ in pieces)
        ids = [i for _, p in pieces for i in p]
        self.sent_text += text
        self.sent_ids += ids
        c = out.outputs[0]
        logprobs = c.logprobs[: len(self.sent_ids)] if c.logprobs is not None else None
        choice = replace(
            c, text=self.sent_text, token_ids=list(self.sent_ids), logprobs=logprobs,
            finish_reason=reason or (c.finish_reason if finished else None),
        )  # fmt: skip
        return replace(
            out, outputs=[choice], finished=finished, delta_text=text, delta_token_ids=ids,
            num_generated_tokens=len(self.sent_ids),
        )  # fmt: skip

    async def _whole(self, out: RequestOutput) -> RequestOutput:
        """n > 1, judged whole at the end: a blocked choice keeps the text before its hit."""
        choices = []
        for c in out.outputs:
            v = await self.gate.evaluate("output", c.text)
            if v.events:
                await self.gate.record(self.job.request_id, v.events)
            if v.block:
                c = replace(c, text=c.text[: v.cut], finish_reason=CONTENT_FILTER)
            elif v.spans:
                c = replace(c, text=redact(c.text, v.spans))
            choices.append(c)
        return replace(out, outputs=choices)
