"""engine/memory/host_malloc.py: glibc's malloc keeps freed blocks in the process (no page faults
per
step). Checked in a fresh interpreter: a large tensor freed and allocated again 20 times
faults all of its pages in every time without the tuning, and at most once or twice with it
(the heap grows to its working size, then is reused)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys, torch
if sys.argv[1] == "tuned":  # as the engine process does: its modules loaded, then the tuning
    import loraplex.engine.llm_engine
    from loraplex.engine.memory.host_malloc import keep_freed_memory
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm up
    t = torch.empty(8 << 20); t.fill_(1.0); del t
before = faults()
for _ in range(20):  # 32 MB allocated, touched and freed, as a step's gathered KV is
    t = torch.empty(8 << 20); t.fill_(1.0); del t
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    return int(out.stdout.split()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    plain, tuned = _faults("plain"), _faults("tuned")
    assert plain > 20 * 8000  # 32 MB = 8,192 pages, faulted in again after every free
    assert 4 * tuned < plain  # the heap grows once or twice to its working size, then no more
