"""A /v1/completions request with a list of prompts: one job (engine request, usage record)
per prompt, all started before any is awaited so the engine batches them together.

`JobGroup` stands in for one job and its service where a single job streams (`AnswerStream`,
platform/openai/streaming.py): it merges the prompts' outputs in arrival order, finishes every
job, and gives each job the tokens of the events that carried its choices once they are
delivered, so each prompt's usage record holds exactly what its client received.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from loraplex.engine import RequestOutput
from loraplex.platform.errors import APIError
from loraplex.platform.serving import InferenceService, Job


@dataclass
class Tagged:
    """One prompt's output in the merged stream; `finished`: every prompt has finished."""

    prompt: int
    out: RequestOutput
    finished: bool


async def start_jobs(service: InferenceService, prompts: list[list[int]], start) -> list[Job]:
    """`start(prompt_ids)` for each prompt; a refusal of any (context length, quota) gives the
    ones already admitted back their reservation (none has run) and is raised."""
    jobs: list[Job] = []
    try:
        for p, ids in enumerate(prompts):
            try:
                jobs.append(await start(ids))
            except APIError as e:
                raise refused(e, p) from None
    except BaseException:
        for job in jobs:
            await service.release(job)
        raise
    return jobs


async def run_all(service: InferenceService, jobs: list[Job], request: Request, run_one):
    """Every job to its end together (`run_one(service, job, request)`); if one fails, the
    others are aborted (and billed what they were sent: nothing) and its error is raised."""

    async def one(p: int, job: Job):
        try:
            return await run_one(service, job, request)
        except APIError as e:
            raise refused(e, p) from None

    tasks = [asyncio.create_task(one(p, job)) for p, job in enumerate(jobs)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class JobGroup:
    def __init__(self, service: InferenceService, jobs: list[Job], request_id: str) -> None:
        self.service, self.jobs, self.request_id = service, jobs, request_id
        self._sent = 0
        # (prompt, tokens) of each rendered event, in the order they are sent
        self._rendered: deque[tuple[int, int]] = deque()

    # ------------------------------------------------------------ as the job
    @property
    def prompt_ids(self) -> list[int]:  # usage counts its length: every prompt's tokens
        return [t for job in self.jobs for t in job.prompt_ids]

    @property
    def cached_tokens(self) -> int:
        return sum(job.cached_tokens for job in self.jobs)

    @property
    def sent_tokens(self) -> int:
        return self._sent

    @sent_tokens.setter
    def sent_tokens(self, total: int) -> None:
        """Delivered events' tokens go to the jobs whose choices they carried, in order."""
        left, self._sent = total - self._sent, total
        while left > 0:
            prompt, tokens = self._rendered.popleft()
            take = min(tokens, left)
            self.jobs[prompt].sent_tokens += take
            if take < tokens:
                self._rendered.appendleft((prompt, tokens - take))
            left -= take

    def rendered(self, prompt: int, tokens: int) -> None:
        """An event carrying `tokens` of `prompt`'s choices was made (delivered later)."""
        self._rendered.append((prompt, tokens))

    # ------------------------------------------------------------ as the service
    @property
    def state(self):
        return self.service.state

    async def outputs(self, _group: JobGroup, **kw) -> AsyncIterator[Tagged]:
        streams = [self.service.outputs(job, **kw) for job in self.jobs]
        # Each prompt's first step submits its engine request: all are submitted before
        # anything is awaited.
        waiting = {asyncio.ensure_future(s.__anext__()): p for p, s in enumerate(streams)}
        running = len(streams)
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=waiting.__getitem__):
                    p = waiting.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    except APIError as e:
                        raise refused(e, p) from None
                    if out.finished:
                        running -= 1
                    else:
                        waiting[asyncio.ensure_future(streams[p].__anext__())] = p
                    yield Tagged(p, out, finished=running == 0)
        finally:
            for fut in waiting:
                fut.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            for s in streams:
                await s.aclose()

    async def finish(self, _group: JobGroup, status: str | None = None) -> None:
        """One usage record per prompt: the prompt that failed says error, the others were
        stopped with it (aborted) or ended as the request did."""
        for job in self.jobs:
            if job.status == "error":
                await self.service.finish(job, "error")
            else:
                await self.service.finish(job, "aborted" if status == "error" else status)


def refused(e: APIError, prompt: int) -> APIError:
    """An error about one prompt of a list says which one (a kind of its own is kept)."""
    if type(e) is not APIError:
        return e
    return APIError(e.status, f"prompt {prompt}: {e.message}", e.code, e.param, headers=e.headers)
