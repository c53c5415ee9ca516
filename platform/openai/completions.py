"""/v1/completions answers, whole or as they stream: a prompt's choices (echo, legacy
logprobs, vLLM's prompt_logprobs), a list of prompts' choices numbered prompt by prompt, and
vLLM's continuous usage."""

from __future__ import annotations

import time

from fastapi import Request

from loraplex.engine import RequestOutput
from loraplex.platform.guardrails.hooks import guard_input, guard_output
from loraplex.platform.openai.logprobs import LegacyLogprobs, joined, vllm_prompt_logprobs
from loraplex.platform.openai.prompt_batch import JobGroup, Tagged, run_all, start_jobs
from loraplex.platform.openai.protocol import CompletionRequest
from loraplex.platform.openai.responses import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionStreamChoice,
    PromptTokensDetails,
    Usage,
)
from loraplex.platform.openai.sse import MeteredEventStream
from loraplex.platform.openai.streaming import (
    AnswerStream,
    ChoiceDeltas,
    Envelope,
    PlainChunks,
    Rendered,
    RunningUsage,
    run_to_end,
    usage_of,
)
from loraplex.platform.serving import InferenceService


async def serve_completion(
    body: CompletionRequest, request: Request, state, caller
) -> Completion | MeteredEventStream:
    service = InferenceService(state)
    body.check_supported()
    lora, adapter = await service.resolve(caller, body.model, body.user)
    samples = max(body.n, body.best_of or 1)
    prompts, gate = await guard_input(
        state, caller, "completions", body.prompts(), stream=body.stream, n=samples,
        logprobs=body.logprobs,
    )  # fmt: skip
    ids = [_encode(service, body, p) for p in prompts]
    if len(prompts) > 1:
        # Checked once for all (a bad value is the request's fault, not one prompt's).
        body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs)

    def start(prompt_ids: list[int]):  # params each: a request's logits processors are its own
        params = body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs)
        return service.start(
            caller, "completions", body.model, prompt_ids, params, lora, adapter, body.user
        )

    if len(prompts) == 1:
        jobs = [await start(ids[0])]
        job = jobs[0]
    else:  # an engine request and a usage record per prompt, started together
        jobs = await start_jobs(service, ids, start)
        job = group = JobGroup(service, jobs, jobs[0].request_id)
        for p, one in enumerate(jobs):  # the usage records name the answer's id and the prompt
            one.request_id = f"{group.request_id}-{p}"
    await guard_output(gate, jobs, job.request_id)
    tok = state.engine.tokenizer
    choices = [
        CompletionChoices(tok, body, prompt, prompt_ids, p * body.n)
        for p, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True))
    ]
    envelope = Envelope(job.request_id, "text_completion", int(time.time()), body.model)
    if body.stream:
        stream = CompletionStream(envelope, choices, job, body.continuous_usage)
        # A JobGroup stands in for the service and the job (platform/openai/prompt_batch.py).
        runner = service if len(jobs) == 1 else job
        return await AnswerStream(runner, job, stream, body.include_usage).start()
    if len(jobs) == 1:
        last = await run_to_end(service, job, request)
        return whole_answer(envelope, choices[0], job, last)
    lasts = await run_all(service, jobs, request, run_to_end)
    return whole_answer_of_list(envelope, choices, jobs, lasts)


def _encode(service: InferenceService, body: CompletionRequest, prompt) -> list[int]:
    ids = service.encode_prompt(prompt)  # (a 503 while the model loads)
    if isinstance(prompt, str) and not body.add_special_tokens:  # vLLM's: no BOS added
        ids = service.state.engine.tokenizer.encode(prompt, add_special_tokens=False)
    return body.truncated(ids)


class CompletionChoices:
    """One prompt's choices of a /v1/completions answer, whole or as they stream. With a list
    of prompts, prompt p's choices are numbered from p * n, as OpenAI's API and vLLM do."""

    def __init__(self, tok, body: CompletionRequest, prompt, prompt_ids, first: int) -> None:
        self.tok, self.body, self.prompt_ids, self.first = tok, body, prompt_ids, first
        # echo: the prompt goes before each choice's text (its first chunk when streamed)
        self.echo = "" if not body.echo else prompt if isinstance(prompt, str) else None
        if self.echo is None:
            self.echo = tok.decode(prompt_ids, skip_special_tokens=True)
        self.many = ChoiceDeltas()
        self.echoed: set[int] = set()
        self.streamed_logprobs: dict[int, LegacyLogprobs] = {}  # per choice, as it streams

    def _echoing(self, i: int, text: str) -> str:
        if self.echo and i not in self.echoed:
            self.echoed.add(i)
            return self.echo + text
        return text

    def _logprobs(self, out: RequestOutput, i: int, start: int, end: int, built=None):
        """Choice i's logprobs piece for its tokens [start, end) and the builder for its next
        piece; a choice's first piece starts with the prompt's (echo)."""
        c = out.outputs[i]
        ids, entries = c.token_ids[start:end], (c.logprobs or [])[start:end]
        if built is not None:
            return CompletionLogprobs(**built.generated(ids, entries)), built
        built = LegacyLogprobs(self.tok, self.prompt_ids, self.body.logprobs)
        first = built.echoed(out.prompt_logprobs, self.echo) if self.body.echo else {}
        return CompletionLogprobs(**joined(first, built.generated(ids, entries))), built

    def _streamed(self, out: RequestOutput, i: int, start: int, end: int):
        if self.body.logprobs is None:
            return None
        piece, self.streamed_logprobs[i] = self._logprobs(
            out, i, start, end, self.streamed_logprobs.get(i)
        )
        return piece

    def chunk(self, out: RequestOutput) -> tuple[list[CompletionStreamChoice], int]:
        """The streamed choices `out` brings (none if nothing new) and the tokens they carry."""
        if self.body.n > 1:
            choices, total = [], 0
            for i, text, start, n, finish in self.many.deltas(out):
                lps = self._streamed(out, i, start, start + n)
                choices.append(CompletionStreamChoice(
                    index=self.first + i, text=self._echoing(i, text), logprobs=lps,
                    finish_reason=finish,
                ))  # fmt: skip
                total += n
            return choices, total
        n = len(out.delta_token_ids)
        start = len(out.outputs[0].token_ids) - n
        if not n and not out.finished and not out.delta_text:
            return [], 0
        choice = CompletionStreamChoice(
            index=self.first,
            text=self._echoing(0, out.delta_text),
            logprobs=self._streamed(out, 0, start, start + n),
            finish_reason=out.outputs[0].finish_reason if out.finished else None,
        )
        return [choice], n

    def whole(self, last: RequestOutput, i: int) -> CompletionChoice:
        out = last.outputs[i]
        lps = None
        if self.body.logprobs is not None:
            lps = self._logprobs(last, i, 0, len(out.token_ids))[0]
        extra = {}
        if self.body.prompt_logprobs is not None:  # vLLM's extension, on each choice as vLLM's
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok, self.prompt_ids, last.prompt_logprobs, self.body.prompt_logprobs
            )
        return CompletionChoice(
            index=self.first + i, text=self.echo + out.text, finish_reason=out.finish_reason,
            logprobs=lps, **extra,
        )  # fmt: skip

    def all(self, last: RequestOutput) -> list[CompletionChoice]:
        return [self.whole(last, i) for i in range(len(last.outputs))]


class CompletionStream:
    """A /v1/completions stream's state: each prompt's choices as they stream, and the running
    usage. Fed engine outputs (one prompt) or `Tagged` ones (a list, through a `JobGroup`,
    which learns which prompt each chunk's tokens belong to)."""

    def __init__(self, envelope: Envelope, prompts: list[CompletionChoices], job,
                 continuous_usage: bool) -> None:  # fmt: skip
        self.envelope, self.prompts = envelope, prompts
        self.group = job if isinstance(job, JobGroup) else None
        self.running = RunningUsage(job) if continuous_usage else None
        body = prompts[0].body
        plain = self.group is None and self.running is None
        # One prompt, one choice of text per chunk: its events written directly.
        plain = plain and body.n == 1 and body.logprobs is None
        self.plain = PlainChunks(envelope, prompts[0].first) if plain else None

    def chunks(self, item: RequestOutput | Tagged) -> tuple[list[CompletionChunk | Rendered], int]:
        if self.plain is not None:  # what CompletionChoices.chunk makes of it, as text
            n = len(item.delta_token_ids)
            if not n and not item.finished and not item.delta_text:
                return [], 0
            finish = item.outputs[0].finish_reason if item.finished else None
            return [self.plain.event(self.prompts[0]._echoing(0, item.delta_text), finish)], n
        prompt, out = (item.prompt, item.out) if isinstance(item, Tagged) else (0, item)
        parts, n = self.prompts[prompt].chunk(out)
        if self.group is not None:
            self.group.rendered(prompt, n)
        chunks = [self._chunk(parts)] if parts else []
        if self.running is not None:
            self.running.add(chunks, n)
        return chunks, n

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return self._chunk([], usage=usage)

    def _chunk(self, choices: list[CompletionStreamChoice], **usage) -> CompletionChunk:
        return CompletionChunk(**self.envelope.fields(), choices=choices, **usage)


def whole_answer(envelope: Envelope, choices: CompletionChoices, job, last) -> Completion:
    return Completion(**envelope.fields(), choices=choices.all(last), usage=usage_of(job))


def whole_answer_of_list(envelope: Envelope, prompts: list[CompletionChoices], jobs,
                         lasts: list[RequestOutput]) -> Completion:  # fmt: skip
    """The choices are prompt 0's n, then prompt 1's...; the usage is their sum."""
    prompt = sum(len(j.prompt_ids) for j in jobs)
    sent = sum(j.sent_tokens for j in jobs)
    usage = Usage(
        prompt_tokens=prompt, completion_tokens=sent, total_tokens=prompt + sent,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(j.cached_tokens for j in jobs)),
    )  # fmt: skip
    choices = [c for p, last in zip(prompts, lasts, strict=True) for c in p.all(last)]
    return Completion(**envelope.fields(), choices=choices, usage=usage)
