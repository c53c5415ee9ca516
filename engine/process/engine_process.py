"""The engine in a process of its own, for servers (the split vLLM v1 makes).

In one process, the engine thread and the server's event loop (HTTP, SSE, database calls in
worker threads) take turns holding the GIL, and every step waits for the others' Python
work. Here the engine steps in a child process with its own interpreter; the server side
keeps only queues, the tokenizer and a reader thread:

    server process                                    engine process (spawned)
    generate() ── JSON commands (add / abort / stop) ──▶ EngineCore.run (engine/core.py)
    asyncio queues ◀── reader thread ◀── JSON output deltas + stats, one message per step
                                          (or per few short steps, each step's deltas in it)

Messages are JSON over two one-way pipes, never pickles; a step's outputs carry only what
changed per request (engine/process/output_deltas.py), and the reader rebuilds whole outputs. An
error a request causes (bad input, an adapter that cannot be loaded or read) comes back typed
to that request's caller; if the engine process dies, every waiting caller gets
EngineDeadError and /readyz says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from loraplex.engine import errors
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import (
    AbortRequest,
    AddRequest,
    Command,
    CommandSource,
    PauseRequest,
    ResumeRequest,
    Stop,
)
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.memory.budget import MemoryReport
from loraplex.engine.models.spec import ModelSpec, spec_from_config
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.process.async_engine import StreamingEngine
from loraplex.engine.process.command_queue import CommandQueue
from loraplex.engine.process.output_deltas import (
    OutputDecoder,
    OutputEncoder,
    RequestError,
    StepMessage,
)
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest
from loraplex.engine.stats import EngineStats

log = logging.getLogger("loraplex.engine")

# Far more than a burst of requests that an engine reading between steps ever leaves
# queued, far fewer than would hold much memory while it reads nothing.
MAX_QUEUED_REQUESTS = 64
STATS_EVERY_S = 0.25  # the child's metrics snapshot, at most this often while busy
# Outputs of steps faster than this go out together, one message per COALESCE_S: each message
# wakes the server's reader thread, and on a tiny model, whose steps are much shorter than
# COALESCE_S, the wake-ups cost the engine a noticeable part of its speed (docs/cpu-path.md).
# The message still carries each step's own delta per request, so the server streams a chunk
# per token as without it. A first token, a finish, an error go out at once; a slower model
# (steps over COALESCE_S) is unaffected.
COALESCE_S = 0.004


def _send(conn: Connection, msg: list) -> None:
    conn.send_bytes(json.dumps(msg, separators=(",", ":")).encode())


def _request_error(request_id: str, e: BaseException) -> RequestError:
    """An error of the engine's typed errors crosses the pipe as its type and fields
    (engine/errors.py); anything else as a RuntimeError with its text."""
    return RequestError(request_id, *errors.to_message(e))


def _error_from(e: RequestError) -> BaseException:
    return errors.from_message(e.type, e.message, e.param)


# ---------------------------------------------------------------------------- child


def _child_main(
    config: dict,
    commands: Connection,
    outputs: Connection,
    progress: bool,
    log_level: int,
    coalesce_s: float,
) -> None:
    from loraplex.engine.core import EngineCore  # torch & co. load here, in the child
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.memory.host_malloc import keep_freed_memory

    # This process only runs the engine. Tuned once the engine's modules are loaded and
    # before the model is: measured so (tests/engine/test_host_malloc.py), the heap then
    # reaches its working size at once; tuned before those imports it grew several times.
    keep_freed_memory()

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(message)s")

    try:
        engine = LLMEngine(EngineConfig(**config), progress=progress)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        _send(outputs, ["failed", " ".join(f"{type(e).__name__}: {e}".split())])
        return
    cfg = dataclasses.asdict(engine.config)
    _send(outputs, ["ready", cfg, dataclasses.asdict(engine.memory)])
    encoder = OutputEncoder()  # how much of each running request's output has gone out

    def sink(results, stats) -> None:
        msg = StepMessage()
        for rid, item in results:
            if isinstance(item, BaseException):  # that request's error (bad input, adapter)
                msg.errors.append(_request_error(rid, item))
                encoder.forget(rid)
            else:
                msg.outputs.append(encoder.encode(item))
        if stats is not None:
            msg.stats = dataclasses.asdict(stats)
        outputs.send_bytes(msg.to_json())

    try:
        core = EngineCore(engine, stats_every_s=STATS_EVERY_S, coalesce_s=coalesce_s)
        # a tensor-parallel group's ranks are watched while idle too: a rank that dies
        # between requests ends this process (EngineDeadError), so /readyz says so at once
        tp = getattr(getattr(engine, "runner", None), "tp", None)
        core.run(_PipeSource(commands, tp.check_alive if tp is not None else None), sink)
    except (EOFError, BrokenPipeError, OSError):
        return  # the server went away
    finally:
        engine.close()  # within the parent's shutdown grace: the tiers' flush is bounded
        engine.adapters.close()


class _PipeSource(CommandSource):
    """Commands as JSON lists: ["add", id, prompt, params, lora, tenant, weight, priority],
    ["abort", id], ["pause", id], ["resume", id], ["stop"]."""

    def __init__(self, conn: Connection, check: Callable[[], None] | None = None):
        self.conn = conn
        self.check = check  # raises when the engine cannot go on (a dead rank)

    def wait(self, timeout: float) -> bool:
        ready = self.conn.poll(timeout)
        if self.check is not None:
            self.check()
        return ready

    def drain(self) -> list[Command]:
        out: list[Command] = []
        while self.conn.poll(0):
            out.append(_command(json.loads(self.conn.recv_bytes())))
        return out


def _command(cmd: list) -> Command:
    if cmd[0] == "add":
        _, rid, prompt, params, lora, tenant, weight, priority = cmd
        lora = None if lora is None else LoRARequest(*lora)
        return AddRequest(rid, prompt, SamplingParams(**params), lora, tenant, weight, priority)
    if cmd[0] == "abort":
        return AbortRequest(cmd[1])
    if cmd[0] == "pause":
        return PauseRequest(cmd[1])
    if cmd[0] == "resume":
        return ResumeRequest(cmd[1])
    if cmd[0] == "stop":
        return Stop()
    raise ValueError(f"unknown engine command {cmd[0]!r}")


def _shallow_fields(params: SamplingParams) -> dict:
    """The params' fields for JSON: a dict of its values as they are, not `asdict`'s deep
    copy of every list (ten times its cost, on the server's loop, per request); only a value
    that is itself a dataclass is converted."""
    return {
        f.name: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        for f in dataclasses.fields(params)
        for v in (getattr(params, f.name),)
    }


def _encode_command(command: Command) -> list:
    if isinstance(command, AddRequest):
        params = _shallow_fields(command.params or SamplingParams())
        lora = command.lora
        lora = None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]
        return ["add", command.request_id, command.prompt, params, lora, command.tenant,
                command.weight, command.priority]  # fmt: skip
    if isinstance(command, AbortRequest):
        return ["abort", command.request_id]
    if isinstance(command, PauseRequest):
        return ["pause", command.request_id]
    if isinstance(command, ResumeRequest):
        return ["resume", command.request_id]
    return ["stop"]


# ---------------------------------------------------------------------------- parent


class EngineProcess(StreamingEngine):
    """Same caller API as AsyncLLMEngine (generate, abort, stats, shutdown, tokenizer,
    config), with the engine in a spawned child process. The constructor blocks until the
    model is loaded (the child shows the loading progress) and raises if loading failed."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        start_timeout: float = 3600,
        coalesce_s: float = COALESCE_S,
        max_queued_requests: int = MAX_QUEUED_REQUESTS,
    ):
        """`max_queued_requests`: new requests that may wait to be written to the engine
        process (it reads them between steps); one more raises EngineBusy at once."""
        super().__init__()
        ctx = mp.get_context("spawn")  # never fork a process that holds threads and torch
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        fields = dataclasses.asdict(config)
        self._proc = ctx.Process(
            target=_child_main,
            args=(fields, cmd_recv, out_send, progress, log.getEffectiveLevel(), coalesce_s),
            name="loraplex-engine",
            daemon=True,
        )
        self._proc.start()
        cmd_recv.close()
        out_send.close()  # EOF on the reader side once the child is gone
        self._decoder = OutputDecoder()  # touched by the reader thread only
        self._stats: EngineStats | None = None
        # Per message that carried outputs, newest last (benchmarks, tests): its bytes and
        # the steps it covers (the most outputs one request got: see COALESCE_S).
        self.step_bytes: deque[tuple[int, int]] = deque(maxlen=1 << 16)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.spec: ModelSpec = spec_from_config(
            json.loads((Path(config.model) / "config.json").read_text())
        )
        deadline = time.monotonic() + start_timeout
        while not self._out_recv.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode}")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise TimeoutError("the engine process did not load the model in time")
        msg = json.loads(self._out_recv.recv_bytes())
        if msg[0] != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process could not start: {msg[1]}")
        self.config = EngineConfig(**msg[1])
        self.memory = MemoryReport(**msg[2])  # what the engine logged at start
        self._commands = CommandQueue(self._write, self._unwritten, max_queued_requests)
        self._reader = threading.Thread(target=self._read, name="loraplex-engine-io", daemon=True)
        self._reader.start()

    @property
    def weight_bytes(self) -> int:
        return self.memory.weight_bytes

    def _submit(self, command: Command) -> None:
        # Never a pipe write here: the caller is the server's event loop (command_queue.py).
        self._commands.put(command)

    def takes_requests(self) -> bool:
        return self._commands.has_room()

    def _write(self, command: Command) -> None:  # the command queue's thread
        _send(self._cmd_send, _encode_command(command))

    def _unwritten(self, command: Command, e: OSError) -> None:
        # The child is gone: the reader reports it to every caller; a request added since
        # then has no other way to learn it.
        if isinstance(command, AddRequest):
            self._deliver(command.request_id, EngineDeadError(f"engine stopped: {e!r}"))

    def _read(self) -> None:
        try:
            while True:
                raw = self._out_recv.recv_bytes()
                self.heard()
                msg = StepMessage.from_json(raw)
                items: list[tuple[str, object]] = []
                for e in msg.errors:
                    self._decoder.forget(e.request_id)
                    items.append((e.request_id, _error_from(e)))
                for d in msg.outputs:
                    items.append((d.request_id, self._decoder.decode(d)))
                if items:
                    steps = Counter(d.request_id for d in msg.outputs)
                    self.step_bytes.append((len(raw), max(steps.values(), default=1)))
                    self._deliver_all(items)
                if msg.stats is not None:
                    self._stats = EngineStats(**msg.stats)
        except (EOFError, OSError) as e:
            self._proc.join(1)  # reap it, so the exit code (e.g. -9 for SIGKILL) is known
            code = self._proc.exitcode
            self._fail_all(RuntimeError(f"engine process exited (code {code}): {e!r}"))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        alive = self.error is None and self._proc.is_alive()
        s = self._stats
        if s is None:  # no snapshot yet: an idle, empty engine
            s = EngineStats(adapter_slots=self.config.max_loras, block_size=self.config.block_size)
        return dataclasses.replace(s, alive=alive)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(Stop())  # behind the commands still queued
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(timeout)
        self._commands.join(timeout)  # the kill ended a write that waited on the pipe
        self._cmd_send.close()
