"""`loraplex bench serve`: a trace replayed against any OpenAI-compatible server (code in
`loraplex.bench`). The lab's other benchmarks run from a checkout: `python -m benchmarks.<name>`.

Building the parser imports only the standard library; the run imports its modules.
"""

from __future__ import annotations

import argparse
import importlib.util

EXTRA = "pip install 'loraplex[bench]'"


def _serve(args: argparse.Namespace) -> int:
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(
            f"loraplex: error: `loraplex bench serve` draws its chart with matplotlib: {EXTRA} "
            "(or pass --no-plot)"
        )
    from loraplex.bench.serve import run_serve

    doc = run_serve(args)
    return 0 if doc["summary"]["completed"] else 1


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from loraplex.bench.serve import add_serve_args

    b = sub.add_parser("bench", help="load a server with a trace and report latency, throughput")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser(
        "serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="replay a trace against an OpenAI-compatible server",
        description="Replay a seeded trace against an OpenAI-compatible server (loraplex, "
        "vLLM, ...). The checkout's benchmarks/ folder holds the rest of the lab.",
    )
    add_serve_args(p)
    p.set_defaults(func=_serve)
