"""CPU micro-measurements behind choices in the code (docs/benchmarks.md, "Measurements behind
choices in the code"): the figures once written in comments, measured again on this machine.

    python -m benchmarks.cpu_micro argmax          # engine/sampler.py `_argmax`
    python -m benchmarks.cpu_micro topk            # engine/sampler.py TOP_P_CANDIDATES
    python -m benchmarks.cpu_micro xgrammar        # engine/structured_output.py's lazy import
    python -m benchmarks.cpu_micro all --threads 1

Each figure is the median of `--repeats` timed calls after a warm-up call, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def argmax(repeats: int) -> list[str]:
    """Index-tracking reductions against a plain amax, and the blocked argmax per width."""
    from loraplex.engine import sampler

    lines = []
    shapes = [(64, 32_000, torch.float32), (32, 262_144, torch.float32),
              (32, 32_000, torch.bfloat16), (32, 262_144, torch.bfloat16)]  # fmt: skip
    for rows, vocab, dtype in shapes:
        x = torch.randn(rows, vocab).to(dtype)
        shape = f"{rows} x {vocab} {str(dtype).removeprefix('torch.')}"
        lines.append(
            f"{shape}: argmax {_ms(lambda x=x: x.argmax(-1), repeats):.2f} ms, max(dim).indices "
            f"{_ms(lambda x=x: x.max(dim=-1).indices, repeats):.2f} ms, amax "
            f"{_ms(lambda x=x: x.amax(-1), repeats):.2f} ms, _argmax "
            f"{_ms(lambda x=x: sampler._argmax(x), repeats):.2f} ms"
        )
        widths = []
        for w in sampler._ARGMAX_BLOCKS:
            if vocab % w or vocab < 4 * w:
                continue
            saved = sampler._ARGMAX_BLOCKS
            sampler._ARGMAX_BLOCKS = (w,)
            try:
                widths.append(f"{w}: {_ms(lambda x=x: sampler._argmax(x), repeats):.2f}")
            finally:
                sampler._ARGMAX_BLOCKS = saved
        lines.append(f"  blocked argmax by block width (ms): {', '.join(widths)}")
    return lines


def topk(repeats: int) -> list[str]:
    """A full descending sort of each row against topk(TOP_P_CANDIDATES)."""
    from loraplex.engine.sampler import TOP_P_CANDIDATES

    lines = []
    for rows, vocab in ((32, 32_000), (32, 262_144)):
        x = torch.randn(rows, vocab)
        sort = _ms(lambda x=x: x.sort(dim=-1, descending=True), repeats)
        part = _ms(lambda x=x: x.topk(TOP_P_CANDIDATES, dim=-1), repeats)
        lines.append(
            f"{rows} x {vocab} float32: sort {sort:.2f} ms, topk({TOP_P_CANDIDATES}) "
            f"{part:.2f} ms (x{sort / part:.1f})"
        )
    return lines


def xgrammar(repeats: int) -> list[str]:
    """`import xgrammar` in a fresh interpreter, less the interpreter's own start."""

    def run(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0

    bare = statistics.median(run("import torch") for _ in range(repeats))
    full = statistics.median(run("import torch, xgrammar") for _ in range(repeats))
    return [f"import xgrammar (torch already imported): {(full - bare) * 1000:.0f} ms"]


MEASURES = {"argmax": argmax, "topk": topk, "xgrammar": xgrammar}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=[*MEASURES, "all"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for name in MEASURES if args.what == "all" else [args.what]:
        print(f"== {name}")
        for line in MEASURES[name](args.repeats):
            print(line)


if __name__ == "__main__":
    main()
