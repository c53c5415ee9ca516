"""The engine process's command queue (engine/process/command_queue.py): a write that waits on a
full
pipe never holds the caller; new requests beyond the limit are refused at once, commands for
admitted requests never are; order is kept; a gone process fails only what was unwritten."""

from __future__ import annotations

import threading

import pytest

from loraplex.engine.core import AbortRequest, AddRequest, Stop
from loraplex.engine.errors import EngineBusy
from loraplex.engine.process.command_queue import CommandQueue


def _add(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2, 3], None, None, None, 1.0, 0)


def test_a_stuck_engine_refuses_new_requests_beyond_the_limit_and_never_blocks_the_caller():
    reading = threading.Event()  # the engine process reads its pipe again
    written: list = []

    def write(command) -> None:
        reading.wait(30)
        written.append(command)

    queue = CommandQueue(write, lambda c, e: None, max_adds=3)
    for rid in ("a", "b", "c"):  # "a" is being written (waits on the pipe), b and c wait
        queue.put(_add(rid))
    with pytest.raises(EngineBusy):
        queue.put(_add("d"))
    queue.put(AbortRequest("a"))  # about an admitted request: always taken
    while queue.blocked_s() == 0:  # the writer thread is at the pipe
        pass
    reading.set()
    queue.put(Stop())
    queue.join(10)
    assert [getattr(c, "request_id", "stop") for c in written] == ["a", "b", "c", "a", "stop"]
    assert queue.blocked_s() == 0


def test_commands_the_gone_process_never_got_are_reported():
    failed: list = []

    def write(command) -> None:
        raise BrokenPipeError("engine process gone")

    queue = CommandQueue(
        write, lambda c, e: failed.append(getattr(c, "request_id", "stop")), max_adds=4
    )
    queue.put(_add("a"))
    queue.put(AbortRequest("a"))
    queue.put(Stop())
    queue.join(10)
    assert failed == ["a", "a", "stop"]
