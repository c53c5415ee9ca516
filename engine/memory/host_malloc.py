"""Keep freed memory in the engine's process instead of giving it back to the OS each step.

Why this exists (no library does it for us; jemalloc/tcmalloc would need LD_PRELOAD): the CPU
path allocates and frees tens of MB per layer per step (gathered KV rows, activations), and
glibc's malloc hands large blocks straight back to the kernel when they are freed (mmap'd
blocks are unmapped, the heap top is trimmed), so the next step page-faults them in again
(measured: docs/cpu-path.md). With mmap off and a high trim threshold, freed blocks stay in
the heap and are reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("loraplex.engine")

_M_TRIM_THRESHOLD = -1  # mallopt parameters of glibc's malloc.h
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed memory at the heap's top


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process (call once, early); False where it is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused; freed memory goes back to the OS as usual")
    return ok
