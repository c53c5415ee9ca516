"""Commands to the engine process, written to its pipe by a thread of their own.

A pipe write blocks once the pipe is full, and the pipe fills as soon as the engine process
stops reading (paused, stuck in a step, swapping): a write on the server's event loop would
then freeze every route, health probes included. So callers only queue; a writer thread
waits on the pipe. New requests are bounded (`max_adds` waiting at once; one more raises
EngineBusy, which the server answers with 503); the other commands (abort, pause, resume,
stop) concern requests already admitted, are few per request, and are always queued.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from loraplex.engine.core import AddRequest, Command, Stop
from loraplex.engine.errors import EngineBusy


class CommandQueue:
    def __init__(
        self,
        write: Callable[[Command], None],
        on_error: Callable[[Command, OSError], None],
        max_adds: int,
    ):
        """`write` sends one command (blocking while the pipe is full); `on_error` is told of
        each command that could not be written (the engine process is gone)."""
        if max_adds < 1:
            raise ValueError(f"max_adds must be at least 1, not {max_adds}")
        self._write, self._on_error, self.max_adds = write, on_error, max_adds
        self._queue: deque[Command] = deque()
        self._cv = threading.Condition()
        self._adds = 0  # AddRequests queued or being written
        self._writing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine-cmd", daemon=True)
        self._thread.start()

    def put(self, command: Command) -> None:
        """Queue `command`; raises EngineBusy for an AddRequest when `max_adds` wait already."""
        with self._cv:
            if isinstance(command, AddRequest):
                if self._adds >= self.max_adds:
                    raise EngineBusy(
                        f"the engine is not taking requests: {self._adds} wait to be handed "
                        "to it; retry shortly"
                    )
                self._adds += 1
            self._queue.append(command)
            self._cv.notify()

    def has_room(self) -> bool:
        """Whether one more AddRequest would be taken now."""
        return self._adds < self.max_adds

    def blocked_s(self) -> float:
        """How long the write in progress has waited for the engine to read (0: none waits)."""
        since = self._writing_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                command = self._queue.popleft()
                self._writing_since = time.monotonic()
            try:
                self._write(command)
            except OSError as e:  # the engine process is gone: its reader tells every caller
                self._on_error(command, e)
            finally:
                with self._cv:
                    self._writing_since = None
                    if isinstance(command, AddRequest):
                        self._adds -= 1
            if isinstance(command, Stop):
                return
