"""Adapter-count scaling, in the shape of S-LoRA's table: one trace over 4, 64, 1024 adapters.

    python -m benchmarks.scaling --model tiny-llama --counts 4,64,1024 --rate 8 --num-requests 200

Per count: a fresh `loraplex serve` (cold caches, same settings), a short warm-up trace, then
the measured trace. Arrivals, lengths and prompts are identical across counts (the trace's
streams are independent); only which adapter each request names changes. Adapters (rank 8,
random, distinct) are uploaded once into the data dir and reused by later runs.
Writes benchmarks/results/scaling-<model>[-tag].json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.assets import RESULTS_DIR
from loraplex.bench.serve import add_trace_args, model_vocab, slo_of, trace_config


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    p.add_argument("--counts", default="4,64,1024", help="adapter counts to compare")
    p.add_argument("--repeats", type=int, default=1, help="runs per count (order alternates)")
    p.add_argument("--warmup", type=int, default=16, help="requests of each warm-up trace")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="server data dir, kept across runs (default: benchmarks/.cache/serve-<model>)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--max-loras",
        type=int,
        default=64,
        help="adapter slots in a batch (default 64, as --max-num-seqs: the cap never binds; "
        "fewer measures what waiting for a slot costs)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory (default: the server's, 4 x max-loras)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the server")
    add_trace_args(p)
    p.set_defaults(out=RESULTS_DIR)
    p.set_defaults(num_adapters=0)  # set per count


def server_settings(args: argparse.Namespace) -> dict:
    extra = {"max_cpu_loras": args.max_cpu_loras} if args.max_cpu_loras else {}
    return extra | {
        "dtype": args.dtype,
        "max_loras": args.max_loras,
        "max_lora_rank": max(8, args.lora_rank),
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
    }


def run_scaling(args: argparse.Namespace) -> dict:
    from benchmarks import assets
    from benchmarks.server import LoraplexServer
    from loraplex.bench.metrics import summarize
    from loraplex.bench.plots import plot_compare
    from loraplex.bench.replay import run_replay
    from loraplex.bench.sysinfo import machine
    from loraplex.bench.targets import HTTPTarget
    from loraplex.bench.trace import make_trace

    counts = [int(c) for c in args.counts.split(",")]
    model_dir, adapters = assets.prepare(args.model, max(counts), rank=args.lora_rank)
    model_name = model_dir.name if args.model not in ("tiny-llama", "demo") else args.model
    data_dir = args.data_dir or assets.CACHE_DIR / f"serve-{model_name}"
    args.num_adapters = counts[0]  # replaced per count below
    base_cfg = trace_config(args, model_vocab(model_dir))
    settings = server_settings(args)
    runs = []
    print(f"scaling: {base_cfg.describe()} over {counts} adapters", file=sys.stderr)
    for rep in range(args.repeats):
        for n in counts if rep % 2 == 0 else counts[::-1]:
            cfg = replace(base_cfg, num_adapters=n)
            warm = replace(cfg, num_requests=args.warmup, seed=cfg.seed + 10_000)
            log = data_dir / f"server-scaling-{n}.log"
            srv = LoraplexServer(model_dir, data_dir, log=log, threads=args.threads, **settings)
            with srv:
                names = srv.upload_all(adapters[:n], progress=not args.no_progress)
                target = HTTPTarget(srv.url, srv.api_key, names, srv.model_name)
                if args.warmup:
                    run_replay(target, make_trace(warm), progress=False)
                    target = HTTPTarget(srv.url, srv.api_key, names, srv.model_name)
                results = run_replay(
                    target,
                    make_trace(cfg),
                    max_concurrency=args.max_concurrency,
                    progress=not args.no_progress,
                    desc=f"{n} adapters",
                )
            summary = summarize(results, slo_of(args))
            runs.append({"num_adapters": n, "repeat": rep, "summary": summary})
            print(
                f"  {n:5d} adapters: {summary['output_throughput'] or 0:.1f} tok/s, "
                f"TTFT p50 {(summary['ttft']['p50'] or 0) * 1000:.0f} ms, "
                f"{summary['errors']} errors",
                file=sys.stderr,
            )
    rows = table_rows(runs, counts)
    doc = {
        "kind": "scaling",
        "model": model_name,
        "trace": {
            **base_cfg.__dict__,
            "input_len": str(base_cfg.input_len),
            "output_len": str(base_cfg.output_len),
            "description": base_cfg.describe().replace(f"{counts[0]} adapters", "N adapters"),
        },
        "server": {**settings, "threads": args.threads},
        "machine": machine(),
        "argv": sys.argv,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": runs,
        "rows": rows,
    }
    if base_cfg.rate == float("inf"):
        doc["trace"]["rate"] = "inf"
    print(format_rows(rows))
    name = f"scaling-{model_name}" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.no_plot:
        plot_compare(
            [{**r, "label": str(r["num_adapters"])} for r in rows],
            args.out / f"{name}.png",
            f"loraplex, {model_name}: throughput and TTFT vs number of adapters",
            "adapters",
        )
    print(f"wrote {args.out / name}.json", file=sys.stderr)
    return doc


def table_rows(runs: list[dict], counts: list[int]) -> list[dict]:
    """Medians over repeats per adapter count, and throughput relative to the smallest count."""
    rows = []
    for n in counts:
        mine = [r["summary"] for r in runs if r["num_adapters"] == n]

        def med(get, mine=mine):
            vals = [v for v in map(get, mine) if v is not None]
            return statistics.median(vals) if vals else None

        rows.append(
            {
                "num_adapters": n,
                "output_throughput": med(lambda s: s["output_throughput"]),
                "request_throughput": med(lambda s: s["request_throughput"]),
                "ttft_p50": med(lambda s: s["ttft"]["p50"]),
                "ttft_p99": med(lambda s: s["ttft"]["p99"]),
                "tpot_p50": med(lambda s: s["tpot"]["p50"]),
                "slo_attainment": med(lambda s: s["slo"]["attainment"]),
                "errors": sum(s["errors"] for s in mine),
            }
        )
    first = rows[0]["output_throughput"] if rows else None
    by_repeat = {(r["num_adapters"], r["repeat"]): r["summary"]["output_throughput"] for r in runs}
    for r in rows:
        tp = r["output_throughput"]
        r["vs_first"] = tp / first if tp is not None and first else None
        # Each repeat's runs are minutes apart, repeats further: pairing a count's run with
        # the fewest count's run of the same repeat cancels the machine's drift between
        # repeats (as `benchmarks.peers` does for systems).
        paired = [
            tp_n / tp_1
            for (n, rep), tp_n in by_repeat.items()
            if n == r["num_adapters"]
            and tp_n is not None
            and (tp_1 := by_repeat.get((counts[0], rep)))
        ]
        r["vs_first_paired"] = statistics.median(paired) if paired else None
    return rows


def format_rows(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{'adapters':>8s} {'tok/s':>9s} {'req/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
    head += f"{'TPOT p50':>9s} {'vs first':>8s} {'paired':>7s} {'errors':>6s}"
    lines = [head]
    for r in rows:
        ms = {
            k: None if r[k] is None else r[k] * 1000 for k in ("ttft_p50", "ttft_p99", "tpot_p50")
        }
        lines.append(
            f"{r['num_adapters']:>8d} {f(r['output_throughput'], '.1f'):>9s} "
            f"{f(r['request_throughput'], '.2f'):>7s} {f(ms['ttft_p50'], '.0f'):>9s} "
            f"{f(ms['ttft_p99'], '.0f'):>9s} {f(ms['tpot_p50'], '.1f'):>9s} "
            f"{f(r['vs_first'], '.3f'):>8s} {f(r.get('vs_first_paired'), '.3f'):>7s} "
            f"{r['errors']:>6d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("scaling", adapters=True, plot=not args.no_plot)
    run_scaling(args)


if __name__ == "__main__":
    main()
