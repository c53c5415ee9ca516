"""The engine for servers: a background thread steps the engine; callers await token streams.

    asyncio callers ──commands (add / abort)──▶ queue ──▶ engine thread: EngineCore.run
          ▲                                                      │
          └────── per-request asyncio.Queue ◀── call_soon_threadsafe(outputs)

The thread runs the same core loop as the engine process (engine/core.py). Only the engine
thread touches the engine, so no locks guard its internals. A caller that
stops iterating (client disconnect, task cancelled) aborts its request, which frees its
KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import AbortRequest, AddRequest, Command, CommandSource, EngineCore, Stop
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest
from loraplex.engine.stats import EngineStats, engine_stats


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in pairs:
        q.put_nowait(item)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an internal error; requests cannot be served."""


class StreamingEngine:
    """The caller side shared by the in-thread and the out-of-process engine: per-request
    asyncio queues fed from another thread, `generate()` and `abort()` over them.

    Subclasses submit commands (`_submit`, engine/core.py's command types) and call
    `_deliver_all` from their engine-facing thread with (request id, RequestOutput or
    exception) pairs.
    """

    config: EngineConfig
    tokenizer: object

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self.error: BaseException | None = None

    def _submit(self, command: Command) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (each with `delta_text`); the last has finished=True.

        Raises ValueError/AdapterError for bad input, AdapterUnavailable when the adapter's
        files cannot be read, before yielding anything. `weight` is the tenant's fair share.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        self._streams[rid] = stream
        self._submit(AddRequest(rid, prompt, params, lora_request, tenant, weight))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._submit(AbortRequest(request_id))

    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their callers: one wake-up per event loop for a whole step's outputs
        (a wake-up is a syscall and a loop turn; per output they cost more than the step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _fail_all(self, error: BaseException) -> None:
        self.error = error
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine stopped: {error!r}"))


class _QueueSource(CommandSource):
    def __init__(self) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.wake = threading.Event()

    def put(self, command: Command) -> None:
        self.commands.put(command)
        self.wake.set()

    def wait(self, timeout: float) -> bool:
        ready = self.wake.wait(timeout)
        self.wake.clear()
        return ready or not self.commands.empty()

    def drain(self) -> list[Command]:
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out


class AsyncLLMEngine(StreamingEngine):
    """The engine stepped by a thread of this process."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self._core = EngineCore(engine)
        self._source = _QueueSource()
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> AsyncLLMEngine:
        return cls(LLMEngine(config, progress=progress))

    def _submit(self, command: Command) -> None:
        self._source.put(command)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._source.put(Stop())
        self._thread.join(timeout)
        self.engine.adapters.close()

    @property
    def num_unfinished(self) -> int:
        return len(self.engine.requests)

    def stats(self) -> EngineStats:
        """A snapshot for metrics; read without locking, so counts may be one step stale."""
        return engine_stats(self.engine, self.error is None and self._thread.is_alive())

    def _loop(self) -> None:  # the engine thread
        def sink(results, _stats) -> None:
            self._deliver_all(results)

        try:
            self._core.run(self._source, sink)
        except BaseException as e:  # noqa: BLE001 - report to every waiting caller
            self._fail_all(e)
            self._core.abort_all(sink)
            raise
