"""The engine for servers: a background thread steps the engine; callers await token streams.

    asyncio callers ──commands (add / abort)──▶ queue ──▶ engine thread: EngineCore.run
          ▲                                                      │
          └────── per-request asyncio.Queue ◀── call_soon_threadsafe(outputs)

The thread runs the same core loop as the engine process (engine/core.py). Only the engine
thread touches the engine, so no locks guard its internals. A caller that
stops iterating (client disconnect, task cancelled) aborts its request, which frees its
KV blocks at the next step boundary.

Backpressure: a stream with a `window` pauses its request in the engine once the outputs
queued for it and not yet taken by its reader hold more than `window` tokens (a server's
reader stops taking while the client's connection accepts nothing), and resumes it when
the reader has caught up to half the window. A paused request costs no steps and keeps its
KV (engine/scheduling/scheduler.py).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import (
    AbortRequest,
    AddRequest,
    Command,
    CommandSource,
    EngineCore,
    PauseRequest,
    ResumeRequest,
    Stop,
)
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest
from loraplex.engine.snapshot import engine_stats
from loraplex.engine.stats import EngineStats


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # (output or exception, the output's tokens so far)
    window: int | None = None  # tokens the engine may run ahead of the reader
    made: int = 0  # tokens in the outputs queued so far (the loop's thread counts)
    taken: int = 0  # … and in those the reader took
    paused: bool = False
    cut: BaseException | None = None  # raised to the reader at its next output


def _tokens(item: object) -> int:
    """Tokens generated so far in an output (all samples)."""
    if not isinstance(item, RequestOutput):
        return 0
    return sum(len(c.token_ids) for c in item.outputs)


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
        # The engine's last sign of life (an output, a stats snapshot, a loop turn), and when
        # it last went from no request to one: see `unresponsive_s`.
        self._heard = self._busy_since = time.monotonic()

    def heard(self) -> None:
        """The engine showed it runs (called from its engine-facing thread)."""
        self._heard = time.monotonic()

    def takes_requests(self) -> bool:
        """Whether a new request would be taken now (False: `generate` would raise
        EngineBusy); a server asks before it charges a request's quota."""
        return True

    def unresponsive_s(self) -> float:
        """How long the engine has held requests without a sign of life; 0 while it holds
        none (an idle engine sends nothing, and need not). A busy engine gives one each step
        (engine/core.py's stats snapshot while busy), so this grows only while it is stuck
        or stopped."""
        if not self._streams:
            return 0.0
        return max(0.0, time.monotonic() - max(self._heard, self._busy_since))

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
        window: int | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (each with `delta_text`); the last has finished=True.

        Raises ValueError/AdapterError for bad input, AdapterUnavailable when the adapter's
        files cannot be read, before yielding anything. `weight` is the tenant's fair share.
        `window`: pause the request while more than this many of its tokens wait for this
        iterator to take them (see the module doc); None: never pause. `priority`: the
        request's class, 0 interactive, 1 batch (engine/sequence.py).
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), window)
        if not self._streams:
            self._busy_since = time.monotonic()
        self._streams[rid] = stream
        try:
            self._submit(AddRequest(rid, prompt, params, lora_request, tenant, weight, priority))
        except BaseException:  # not taken (EngineBusy): nothing to abort
            self._streams.pop(rid, None)
            raise
        finished = False
        try:
            while True:
                item, stream.taken = await stream.queue.get()
                if stream.cut is not None:
                    raise stream.cut
                if isinstance(item, BaseException):
                    raise item
                if stream.paused and stream.made - stream.taken <= stream.window // 2:
                    stream.paused = False
                    self._submit(ResumeRequest(rid))
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

    def queued(self, request_id: str) -> int:
        """Outputs of a request waiting for its `generate` to take them (0: none, or no such
        request): a server that lags behind the engine writes those together. Call from the
        request's event loop."""
        stream = self._streams.get(request_id)
        return 0 if stream is None else stream.queue.qsize()

    def cut(self, request_id: str, error: BaseException) -> bool:
        """End a request's stream now: its iterator raises `error` at once, before any
        output still queued for it, and the request is aborted. Callable from any thread;
        False if no such stream runs here."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False

        def wake() -> None:
            stream.cut = error
            stream.queue.put_nowait((None, stream.taken))

        stream.loop.call_soon_threadsafe(wake)
        return True

    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their callers: one wake-up per event loop for a whole step's outputs
        (a wake-up is a syscall and a loop turn; per output they cost more than the step)."""
        self.heard()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                # Counted here: an output may be a live view the engine goes on extending.
                by_loop.setdefault(stream.loop, []).append((rid, stream, item, _tokens(item)))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(self._queue_all, batch)

    def _queue_all(self, batch: list[tuple[str, _Stream, object, int]]) -> None:
        """On the streams' loop: queue the outputs; pause a request whose reader lags."""
        for rid, stream, item, made in batch:
            stream.queue.put_nowait((item, made))
            stream.made = max(stream.made, made)
            lag = stream.made - stream.taken
            live = isinstance(item, RequestOutput) and not item.finished
            if live and stream.window is not None and not stream.paused and lag > stream.window:
                stream.paused = True
                self._submit(PauseRequest(rid))

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
        if not self._thread.is_alive():  # a stuck step may still queue tier writes
            self.engine.close()
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

        def turn() -> bool:  # each loop turn: the thread is alive and stepping
            self.heard()
            return False

        try:
            self._core.run(self._source, sink, stopped=turn)
        except BaseException as e:  # noqa: BLE001 - report to every waiting caller
            self._fail_all(e)
            self._core.abort_all(sink)
            raise
