"""How much CPU other processes took while we measured (the machine is shared).

    machine busy time (/proc/stat)  -  CPU time of our process tree (/proc/<pid>/stat)
    = what everyone else used; divided by wall time it is "cores taken by others".

Our tree is this process and its descendants, so it covers the vLLM worker and its engine
core too. Linux only; elsewhere the figures are NaN and nothing waits.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / _TICK  # minus idle and iowait


def _tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and every live descendant."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        rest = text.rsplit(")", 1)[1].split()  # fields after "(comm)"
        stats[int(entry.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


class OthersMeter:
    """`with OthersMeter() as m: ...` then `m.cores`: cores others used meanwhile."""

    def __enter__(self) -> OthersMeter:
        self.cores = math.nan
        try:
            self._start = (time.perf_counter(), _machine_busy_s(), _tree_cpu_s(os.getpid()))
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        t0, busy0, ours0 = self._start
        try:
            wall = time.perf_counter() - t0
            others = (_machine_busy_s() - busy0) - (_tree_cpu_s(os.getpid()) - ours0)
        except (OSError, ValueError, IndexError):
            return
        self.cores = max(others, 0.0) / max(wall, 1e-9)


def others_cores(interval: float) -> float:
    """Cores others keep busy over the next `interval` seconds (we sleep meanwhile)."""
    with OthersMeter() as m:
        time.sleep(interval)
    return m.cores


def settle(pause: float, wait: float, threshold: float) -> float:
    """Rest `pause` s; keep resting (up to `wait` s more) while others use > threshold cores."""
    busy = others_cores(pause)
    deadline = time.monotonic() + wait
    while busy > threshold and time.monotonic() < deadline:
        busy = others_cores(max(pause, 1.0))
    return busy
