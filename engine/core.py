"""The engine core loop, the one both server modes run: apply commands, step, hand out results.

    commands (Add / Abort / Pause / Resume / Stop) ──▶ EngineCore.run: apply, step, step…
                                                         │
                 sink(results, stats) ◀──────────────────┘  per step: (request id, output
                                                            or the error that request caused)

`AsyncLLMEngine` runs it on a thread of the server process (commands from a queue, results
straight to the callers' asyncio queues); `EngineProcess` runs it in a child process (commands
from a pipe, results encoded as output deltas). Only the loop's thread touches the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest
from loraplex.engine.snapshot import engine_stats, routing_key
from loraplex.engine.stats import EngineStats


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | None
    lora: LoRARequest | None
    tenant: str | None
    weight: float
    priority: int = 0  # the request's class (engine/sequence.py)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class PauseRequest:
    """The request's reader fell behind: no steps for it until resumed (its KV is kept)."""

    request_id: str


@dataclass
class ResumeRequest:
    request_id: str


@dataclass
class Stop:
    pass


Command = AddRequest | AbortRequest | PauseRequest | ResumeRequest | Stop
# What a step hands out: per request, its output or the exception it gets instead.
Result = tuple[str, "RequestOutput | Exception"]


class CommandSource:
    """Where the loop's commands come from (a queue, a pipe)."""

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` s for a command; True if one may be ready."""
        raise NotImplementedError

    def drain(self) -> list[Command]:
        """Every command ready now, without blocking."""
        raise NotImplementedError


class _Coalescer:
    """Holds a request's outputs back until `every_s` passed since the last hand-out: a server
    process then wakes once per few fast steps instead of every step. Each held step's output
    goes out, in order (not merged: a stream still sends a chunk per step, and per token).
    A request's first output, its last, errors, stalls and stats go out at once, so time to
    first token and the end are never delayed."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.held: dict[str, list[RequestOutput | Exception]] = {}
        self.started: set[str] = set()  # requests whose first output went out
        self.last = 0.0

    def take(self, results: list[Result], force: bool) -> list[Result]:
        """Add a step's results; what to hand out now (maybe nothing)."""
        for rid, item in results:
            if isinstance(item, RequestOutput):
                self.held.setdefault(rid, []).append(item)
            else:  # the request's error replaces what it had held: it ends with it
                self.held[rid] = [item]
            if not isinstance(item, RequestOutput) or item.finished or rid not in self.started:
                force = True
        now = time.monotonic()
        if not self.held or not (force or now - self.last >= self.every_s):
            return []
        out = [(rid, item) for rid, items in self.held.items() for item in items]
        self.held.clear()
        self.last = now
        for rid, item in out:
            if isinstance(item, RequestOutput) and not item.finished:
                self.started.add(rid)
            else:
                self.started.discard(rid)
        return out


class EngineCore:
    """Steps one LLMEngine. `stats_every_s`: `run` hands the sink a stats snapshot at least
    this often, and at once whenever what a router reads changed (request counts, adapter
    residency) — so a queue that lasts a step is seen (None: never; a thread-mode caller
    reads the engine directly). `coalesce_s`: a running request's outputs of steps shorter
    than this go to the sink together, at most one batch per `coalesce_s` (0: every step);
    a batch may then hold several outputs of one request, one per step, in step order."""

    IDLE_WAIT_S = 0.05  # idle: block this long on the commands (keeps adapter loads moving)

    def __init__(
        self, engine: LLMEngine, stats_every_s: float | None = None, coalesce_s: float = 0.0
    ):
        self.engine = engine
        self.stats_every_s = stats_every_s
        self._last_stats = 0.0
        self._last_key: tuple | None = None
        self._batch = _Coalescer(coalesce_s) if coalesce_s > 0 else None

    def _out(self, results: list[Result], force: bool) -> list[Result]:
        return results if self._batch is None else self._batch.take(results, force)

    def apply(self, cmd: Command) -> list[Result]:
        """Apply one command; what its caller gets at once (a bad request's error, an aborted
        request's last output)."""
        if isinstance(cmd, AddRequest):
            try:
                # The adapter loads on a loader thread; steps go on meanwhile.
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    cmd.lora,
                    tenant=cmd.tenant,
                    weight=cmd.weight,
                    wait_for_adapter=False,
                    priority=cmd.priority,
                )
            except Exception as e:  # bad input: that caller's error only
                return [(cmd.request_id, e)]
            return []
        if isinstance(cmd, AbortRequest):
            out = self.engine.abort(cmd.request_id)
            return [] if out is None else [(cmd.request_id, out)]
        if isinstance(cmd, PauseRequest):
            self.engine.pause(cmd.request_id)
            return []
        if isinstance(cmd, ResumeRequest):
            self.engine.resume(cmd.request_id)
            return []
        raise TypeError(f"unknown engine command {cmd!r}")

    def step(self) -> list[Result]:
        """One engine step (nothing when idle): each output, or, for a request whose adapter
        failed to load, that error."""
        if not self.engine.has_unfinished():
            return []
        results: list[Result] = []
        for out in self.engine.step():
            err = self.engine.load_errors.pop(out.request_id, None)
            results.append((out.request_id, out if err is None else err))
        return results

    def stats(self, alive: bool = True) -> EngineStats:
        return engine_stats(self.engine, alive)

    def run(
        self,
        source: CommandSource,
        sink: Callable[[list[Result], EngineStats | None], None],
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        """Loop until a Stop command (or `stopped()`): commands first, then a step; the sink
        gets each batch of results, with a stats snapshot every `stats_every_s` while busy.
        On a stop every unfinished request is aborted and handed out; an exception propagates
        with the requests left as they are (the caller fails them, then `abort_all`)."""
        while not stopped():
            if self.engine.has_unfinished() or source.wait(self.IDLE_WAIT_S):
                for cmd in source.drain():
                    if isinstance(cmd, Stop):
                        self.abort_all(sink)
                        return
                    if results := self._out(self.apply(cmd), force=True):
                        sink(results, None)
            results = self.step()
            snapshot = self._snapshot_due()
            # A step that advanced nothing (waiting on an adapter, say) hands out what is held.
            results = self._out(results, force=not results or snapshot is not None)
            if results or snapshot is not None:
                sink(results, snapshot)
        self.abort_all(sink)

    def _snapshot_due(self) -> EngineStats | None:
        if self.stats_every_s is None:
            return None
        key, now = routing_key(self.engine), time.monotonic()
        if key == self._last_key and now - self._last_stats <= self.stats_every_s:
            return None
        self._last_key, self._last_stats = key, now
        return self.stats()

    def abort_all(self, sink: Callable[[list[Result], EngineStats | None], None]) -> None:
        results: list[Result] = []
        for rid in list(self.engine.requests):
            out = self.engine.abort(rid)
            if out is not None:
                results.append((rid, out))
        if results := self._out(results, force=True):
            with contextlib.suppress(EOFError, OSError):  # nobody left to tell
                sink(results, None)
