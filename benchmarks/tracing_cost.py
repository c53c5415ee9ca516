"""What request tracing costs: one trace against `loraplex serve` with tracing absent (its hooks
stubbed out), off (the default: no endpoint) and on (OTLP/HTTP to a local receiver), the three
alternated (ABC, CBA, ...) on one machine; and what each hook costs per call when off.

    python -m benchmarks.tracing_cost --model tiny-llama --repeats 2

"Absent" runs the same server with `loraplex.platform.tracing`'s request-path hooks replaced by
functions that do nothing (a `sitecustomize` on the server's PYTHONPATH), so off against absent
is what the hooks' context-variable reads cost. Small outputs on the tiny model make the
per-request server work as large a share of a request as it gets, so the comparison is at its
most sensitive. The figure is the server process's CPU time per request (user + system, from
/proc), where tracing runs: on a machine shared with other work it holds far steadier than
requests/s, which are reported beside it. Writes `benchmarks/results/tracing-cost-<model>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.assets import RESULTS_DIR, import_installed_kernels
from loraplex.bench.serve import add_trace_args, model_vocab, slo_of, trace_config
from loraplex.bench.trace import LengthDist

VARIANTS = ("absent", "off", "on")
# Imported by the "absent" server at start: the hooks the request path calls become no-ops.
STUB = """\
import loraplex.platform.tracing as t

t.current = lambda: None
t.end_auth = t.phase = t.record_job = lambda *a, **k: None
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the three (order alternates)")
    p.add_argument("--warmup", type=int, default=16, help="requests of each warm-up trace")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the server")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="server data dir (default: benchmarks/.cache/tracing-<model>)")  # fmt: skip
    p.add_argument("--hook-calls", type=int, default=200_000, help="calls per hook timing")
    p.add_argument("--commit", default="HEAD",
                   help="the servers run this commit's code (git archive), so edits in a shared "
                   "checkout during the run cannot change what is measured")  # fmt: skip
    add_trace_args(p)
    p.set_defaults(out=RESULTS_DIR, num_requests=200, rate=float("inf"), max_concurrency=16,
                   input_len=LengthDist(16, 64), output_len=LengthDist(4, 16))  # fmt: skip


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every export and keeps only its count and size."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.exports += 1  # type: ignore[attr-defined]
        self.server.bytes += len(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc): the server process, where
    tracing runs; far steadier than wall-clock rates on a machine others share."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hook_costs(calls: int) -> dict:
    """Nanoseconds per call of each request-path hook with tracing off (no trace current),
    and of `engine_times`, which the server calls once per request, when it ends, whether or
    not it traces (the ledger's queue time comes from it)."""
    from loraplex.engine.outputs import RequestMetrics, RequestOutput
    from loraplex.platform import tracing

    assert tracing.current() is None
    now = time.monotonic()
    out = RequestOutput("r", None, [1], [], False, metrics=RequestMetrics(time.time(), 1.0, 2.0))
    cases = {
        "current()": lambda: tracing.current(),
        "end_auth()": lambda: tracing.end_auth(),
        "phase()": lambda: tracing.phase("adapter_fetch", now, now, source="disk"),
        "engine_times(out)": lambda: tracing.engine_times(out),
        "a call of nothing": lambda: None,
    }
    result = {}
    for name, fn in cases.items():
        best = float("inf")
        for _ in range(5):  # the best of five: the least disturbed by the rest of the machine
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter_ns() - start) / calls)
        result[name] = best
    return result


def run(args: argparse.Namespace) -> dict:
    from benchmarks import assets
    from benchmarks.step import make_shim, resolve_commit, source_tree

    model_dir, adapters = assets.prepare(args.model, args.num_adapters)
    model_name = model_dir.name if args.model not in ("tiny-llama", "demo") else args.model
    commit = resolve_commit(args.commit)
    data_dir = args.data_dir or assets.CACHE_DIR / f"tracing-{model_name}-{commit[:9]}"
    with source_tree(commit) as root:
        shim = make_shim(root, root.parent / f"{root.name}-shim")
        try:
            return _run(args, model_dir, model_name, adapters, data_dir, commit, shim)
        finally:
            shutil.rmtree(shim, ignore_errors=True)


def _run(args, model_dir, model_name, adapters, data_dir, commit, shim) -> dict:
    from benchmarks.server import LoraplexServer
    from loraplex.bench.metrics import summarize
    from loraplex.bench.replay import run_replay
    from loraplex.bench.sysinfo import machine
    from loraplex.bench.targets import HTTPTarget
    from loraplex.bench.trace import make_trace

    cfg = trace_config(args, model_vocab(model_dir))
    warm = replace(cfg, num_requests=args.warmup, seed=cfg.seed + 10_000)
    settings = {"max_num_seqs": args.max_num_seqs, "max_loras": max(1, args.num_adapters)}

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    receiver.exports = receiver.bytes = 0  # type: ignore[attr-defined]
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    stub_dir = Path(tempfile.mkdtemp(prefix="loraplex-tracing-absent-"))
    (stub_dir / "sitecustomize.py").write_text(STUB)

    runs = []
    print(f"tracing cost: {cfg.describe()}", file=sys.stderr)
    for rep in range(args.repeats):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            extra = {"otlp_traces_endpoint": endpoint} if variant == "on" else {}
            srv = LoraplexServer(model_dir, data_dir, log=data_dir / f"server-{variant}.log",
                                 threads=args.threads, **settings, **extra)  # fmt: skip
            saved = os.environ.get("PYTHONPATH")
            # The server copies this environment when it starts: the commit's code first.
            first = [str(stub_dir), str(shim)] if variant == "absent" else [str(shim)]
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, saved]))
            try:
                srv.start()
            finally:
                if saved is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved
            exports_before = receiver.exports  # type: ignore[attr-defined]
            try:
                names = srv.upload_all(adapters, progress=False)
                target = HTTPTarget(srv.url, srv.api_key, names, srv.model_name)
                if args.warmup:
                    run_replay(target, make_trace(warm), progress=False)
                    target = HTTPTarget(srv.url, srv.api_key, names, srv.model_name)
                cpu = cpu_seconds(srv.proc.pid)
                results = run_replay(target, make_trace(cfg), max_concurrency=args.max_concurrency,
                                     progress=False)  # fmt: skip
                cpu = cpu_seconds(srv.proc.pid) - cpu
            finally:
                srv.stop()  # its exporter flushes the last spans on the way down
            exports = receiver.exports - exports_before  # type: ignore[attr-defined]
            summary = summarize(results, slo_of(args))
            cpu_ms = 1000 * cpu / max(1, summary["completed"])
            runs.append({"variant": variant, "repeat": rep, "otlp_exports": exports,
                         "server_cpu_ms_per_request": cpu_ms, "summary": summary})  # fmt: skip
            print(f"  {variant:6s}: {summary['request_throughput'] or 0:.1f} req/s, "
                  f"{summary['output_throughput'] or 0:.1f} tok/s, "
                  f"TTFT p50 {(summary['ttft']['p50'] or 0) * 1000:.1f} ms, "
                  f"server CPU {cpu_ms:.2f} ms/request, "
                  f"{summary['errors']} errors, {exports} OTLP exports",
                  file=sys.stderr)  # fmt: skip
    receiver.shutdown()
    hooks = hook_costs(args.hook_calls)
    rows = []
    for variant in VARIANTS:
        mine = [r["summary"] for r in runs if r["variant"] == variant]
        cpu = [r["server_cpu_ms_per_request"] for r in runs if r["variant"] == variant]

        def med(get, mine=mine):
            values = [v for v in (get(s) for s in mine) if v is not None]
            return statistics.median(values) if values else None

        rows.append({
            "variant": variant,
            "runs": len(mine),
            "req_per_s": med(lambda s: s["request_throughput"]),
            "req_per_s_runs": [s["request_throughput"] for s in mine],
            "cpu_ms": statistics.median(cpu),
            "cpu_ms_runs": cpu,
            "ttft_p50_ms": med(lambda s: s["ttft"]["p50"] and s["ttft"]["p50"] * 1000),
            "e2e_p50_ms": med(lambda s: s["e2e"]["p50"] and s["e2e"]["p50"] * 1000),
            "e2e_p99_ms": med(lambda s: s["e2e"]["p99"] and s["e2e"]["p99"] * 1000),
            "errors": sum(s["errors"] for s in mine),
        })  # fmt: skip
    doc = {
        "kind": "tracing-cost",
        "model": model_name,
        "commit": commit,
        "trace": {**cfg.__dict__, "input_len": str(cfg.input_len),
                  "output_len": str(cfg.output_len), "rate": str(cfg.rate),
                  "max_concurrency": args.max_concurrency, "description": cfg.describe()},
        "server": {**settings, "threads": args.threads},
        "machine": machine(),
        "argv": sys.argv,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": runs,
        "rows": rows,
        "hook_ns_per_call": hooks,
    }  # fmt: skip
    print(format_rows(rows, hooks))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tracing-cost-{model_name}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return doc


def format_rows(rows: list[dict], hooks: dict) -> str:
    def f(x, spec="{:.1f}"):
        return "–" if x is None else spec.format(x)

    off = next(r for r in rows if r["variant"] == "off")
    lines = [
        "| tracing | runs | server CPU ms/request (median) | of each run | vs off "
        "| req/s (median) | of each run | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r["cpu_ms"] / off["cpu_ms"] if off["cpu_ms"] else None
        each_cpu = ", ".join(f(x, "{:.2f}") for x in r["cpu_ms_runs"])
        each = ", ".join(f(x) for x in r["req_per_s_runs"])
        lines.append(f"| {r['variant']} | {r['runs']} | {f(r['cpu_ms'], '{:.2f}')} | {each_cpu} | "
                     f"{f(ratio, '{:.3f}')} | {f(r['req_per_s'])} | {each} | "
                     f"{r['errors']} |")  # fmt: skip
    lines += ["", "| hook, tracing off | ns per call |", "| --- | --- |"]
    lines += [f"| `{name}` | {ns:.0f} |" for name, ns in hooks.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("tracing_cost", adapters=args.num_adapters > 0, plot=False)
    import_installed_kernels()  # before peft / transformers, from a checkout's root
    run(args)


if __name__ == "__main__":
    main()
