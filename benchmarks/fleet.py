"""`python -m benchmarks.fleet`: N replicas behind a router, one S-LoRA-style trace, per policy.

    python -m benchmarks.fleet --replicas 4 --adapters 256 --repeats 2

N engines (AsyncLLMEngine, each stepped by its own thread) in this process, each with few
device slots (`--max-loras`) and a host tier (`--max-cpu-loras`) that holds a quarter of the
adapters, so where a request lands decides whether its adapter must be read from disk. The
trace (bench/trace.py): Poisson arrivals, power-law (Zipf) adapter popularity, short prompts
and outputs. Each policy of benchmarks/fleet_router.py runs on fresh engines: a warm-up trace
(one output token per request, its own seed) fills the caches the way that policy places
adapters, then the measured trace. Per run: cold loads (adapter reads from disk into a
replica's host tier, the adapter manager's own count), slot writes, TTFT p50/p99 (first token
minus the request's scheduled arrival), output throughput. Repeats alternate the policy order.

The replicas share this machine's cores instead of having one device each: a replica the
router leaves idle lends its core to a busy one, which flatters uneven placements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.assets import (
    BENCH_DIR,
    CACHE_DIR,
    import_installed_kernels,
    make_adapters,
    tiny_llama,
)
from benchmarks.fleet_router import POLICIES, ReplicaView, Router
from benchmarks.fleet_store import FleetStore, open_store
from loraplex.bench.metrics import percentile
from loraplex.bench.sysinfo import machine
from loraplex.bench.trace import LengthDist, TraceConfig, TraceRequest, make_trace

WARMUP_RATE = 4  # times --rate: warm-up requests are prefill + 1 token
QUICK = dict(replicas=2, adapters=16, requests=40, warmup=16, rate=20.0, max_cpu_loras=4,
             max_loras=2, output_len="4:8", input_len="8:16")  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama or a model folder")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--adapters", type=int, default=256)
    p.add_argument("--requests", type=int, default=400, help="of the measured trace")
    p.add_argument("--warmup", type=int, default=2500, help="warm-up requests (1 token each)")
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    p.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of popularity")
    p.add_argument("--input-len", default="16:64", help="prompt tokens, N or LOW:HIGH")
    p.add_argument("--output-len", default="8:32", help="output tokens, N or LOW:HIGH")
    p.add_argument("--max-loras", type=int, default=2, help="device slots per replica")
    p.add_argument("--max-cpu-loras", type=int, default=64, help="host tier per replica")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--queue-tolerance", type=float, default=2.0,
                   help="affinity: extra queued requests worth one point of affinity")  # fmt: skip
    p.add_argument("--host-weight", type=float, default=2.0,
                   help="affinity-host: score of holding the adapter in the host tier")  # fmt: skip
    p.add_argument(
        "--store",
        default="local",
        help="local (engines read the adapter folders), moto (a local S3 server), "
        "or s3://bucket/prefix: replicas fetch adapters into their own disk "
        "cache on the request's path, as `serve` does (benchmarks/fleet_store.py)",
    )
    p.add_argument("--s3-endpoint", default=None, help="for --store s3://...")
    p.add_argument(
        "--disk-cache-mb",
        type=int,
        default=8192,
        help="each replica's adapter disk cache with --store (serve's default)",
    )
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--repeats", type=int, default=1, help="runs per policy (order alternates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"a tiny fleet for tests: {QUICK}")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "fleet.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cache", type=Path, default=CACHE_DIR, help="where adapters are made")


def trace_configs(args, vocab: int) -> tuple[TraceConfig, TraceConfig]:
    """(warm-up, measured): the same popularity, the warm-up with its own seed, 1 token."""
    cfg = TraceConfig(num_requests=args.requests, rate=args.rate, num_adapters=args.adapters,
                      alpha=args.alpha, input_len=LengthDist.parse(args.input_len),
                      output_len=LengthDist.parse(args.output_len), vocab_size=vocab,
                      seed=args.seed)  # fmt: skip
    warm = replace(cfg, num_requests=max(args.warmup, 1), rate=args.rate * WARMUP_RATE,
                   output_len=LengthDist(1, 1), seed=args.seed + 10_000)  # fmt: skip
    return warm, cfg


def build_engines(model: Path, args):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.process.async_engine import AsyncLLMEngine

    cfg = EngineConfig(
        str(model), dtype="bfloat16", max_loras=args.max_loras, max_lora_rank=args.lora_rank,
        max_cpu_loras=args.max_cpu_loras, max_num_seqs=args.max_num_seqs, max_model_len=256,
        kv_cache_bytes=64 << 20, num_threads=1, seed=args.seed,
    )  # fmt: skip
    return [AsyncLLMEngine.from_config(cfg) for _ in range(args.replicas)]


async def drive(engines, router: Router, loras: list, trace: list[TraceRequest], args,
                tag: str, store: FleetStore | None = None) -> list[dict]:  # fmt: skip
    """Send `trace` at its arrival times through `router`; one record per request. With a
    store, a replica finds the adapter in its disk cache (or fetches it) first."""
    from loraplex.engine.sampling_params import SamplingParams

    in_flight: list[dict[str, int]] = [{} for _ in engines]
    records: list[dict] = []
    t0 = time.monotonic()

    async def one(i: int, req: TraceRequest, name: str) -> None:
        lora = None if req.adapter is None else loras[req.adapter]
        fetch_s = 0.0
        if lora is not None and store is not None:
            start = time.monotonic()
            folder = await asyncio.to_thread(store.folder, i, req.adapter)
            fetch_s = time.monotonic() - start
            lora = replace(lora, lora_path=folder)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        first = last = None
        async for out in engines[i].generate(req.prompt, params, lora, f"{tag}-{req.index}"):
            if first is None and out.outputs[0].token_ids:
                first = time.monotonic() - t0
            last = out
        in_flight[i][name] -= 1
        records.append({"index": req.index, "replica": i, "adapter": req.adapter,
                        "arrival_s": req.arrival_s, "ttft_s": first - req.arrival_s,
                        "end_s": time.monotonic() - t0, "fetch_s": fetch_s,
                        "tokens": len(last.outputs[0].token_ids),
                        "finish_reason": last.outputs[0].finish_reason})  # fmt: skip

    tasks = []
    for req in trace:
        delay = req.arrival_s - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        name = "base" if req.adapter is None else loras[req.adapter].lora_name
        views = [ReplicaView(e.stats(), args.max_cpu_loras, in_flight[i])
                 for i, e in enumerate(engines)]  # fmt: skip
        i = router.pick(views, None if req.adapter is None else name)
        in_flight[i][name] = in_flight[i].get(name, 0) + 1
        tasks.append(asyncio.create_task(one(i, req, name)))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r["index"])


def _counters(engines) -> list[dict]:
    stats = [e.stats() for e in engines]
    return [{"loads": s.adapter_loads, "misses": s.adapter_misses,
             "slot_writes": s.adapter_slot_writes, "load_s": s.adapter_load_seconds}
            for s in stats]  # fmt: skip


def run_policy(policy: str, model: Path, adapters: list[Path], traces, args,
               store: FleetStore | None = None) -> tuple:  # fmt: skip
    """One run on fresh engines: (row, {"warm", "run"}: per-request records, per-replica
    counters after the warm-up and at the end, and each adapter manager's own load count)."""
    from loraplex.engine.sequence import LoRARequest

    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
    router = Router(policy, args.replicas, seed=args.seed, queue_tolerance=args.queue_tolerance,
                    host_weight=args.host_weight)  # fmt: skip
    engines = build_engines(model, args)
    if store is not None:
        store.fresh_caches(args.replicas)
    try:
        warm, measured = traces
        warm_records = asyncio.run(drive(engines, router, loras, warm, args, "warm", store))
        before = _counters(engines)
        fetched, fetch_times = (store.fetches(), len(store.cold_s)) if store else (0, 0)
        records = asyncio.run(drive(engines, router, loras, measured, args, "run", store))
        after = _counters(engines)
        fetched = store.fetches() - fetched if store else 0
        cold_s = store.cold_s[fetch_times:] if store else []
        host = sum(len(e.engine.adapters.host) for e in engines)
        managers = [e.engine.adapters.counters.loads for e in engines]
    finally:
        for e in engines:
            e.shutdown()
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True))
             for k in ("loads", "misses", "slot_writes", "load_s")}  # fmt: skip
    ttft = [r["ttft_s"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    span = max(r["end_s"] for r in records)
    share = [sum(r["replica"] == i for r in records) / len(records) for i in range(args.replicas)]
    row = {
        "policy": policy, "requests": len(records),
        "finished": sum(r["finish_reason"] == "length" for r in records),
        "cold_loads": delta["loads"], "cold_loads_total": sum(managers),
        "load_waits": delta["misses"], "slot_writes": delta["slot_writes"],
        "load_ms_mean": delta["load_s"] * 1e3 / max(delta["loads"], 1),
        "store_fetches": fetched,
        "fetch_ms_mean": statistics.fmean(cold_s) * 1e3 if cold_s else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "output_tok_s": tokens / span, "output_tokens": tokens, "span_s": span,
        "replica_share": share, "host_adapters_end": host,
    }  # fmt: skip
    counts = {"warmup": before, "end": after, "managers": managers}
    return row, {"warm": warm_records, "run": records}, counts


def apply_quick(args: argparse.Namespace, keep: frozenset[str] = frozenset()) -> None:
    """--quick: the QUICK settings, but for the names in `keep`."""
    if args.quick:
        for k, v in QUICK.items():
            if k not in keep:
                setattr(args, k, v)


def run_fleet(args: argparse.Namespace) -> dict:
    apply_quick(args)
    import_installed_kernels()
    model = tiny_llama() if args.model == "tiny-llama" else Path(args.model)
    adapters = make_adapters(model, model.name, args.adapters, rank=args.lora_rank,
                             cache=args.cache)  # fmt: skip
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    warm, cfg = trace_configs(args, vocab)
    traces = (make_trace(warm), make_trace(cfg))
    # Cold loads no router can avoid: adapters the measured trace names but the warm-up not.
    unseen = {r.adapter for r in traces[1]} - {r.adapter for r in traces[0]}
    print(f"fleet: {args.replicas} replicas x (slots {args.max_loras}, host "
          f"{args.max_cpu_loras}); warm-up {warm.num_requests} x 1 token; {cfg.describe()}",
          flush=True)  # fmt: skip
    runs = []
    with open_store(args, adapters) as store:
        for rep in range(args.repeats):
            for policy in args.policies if rep % 2 == 0 else args.policies[::-1]:
                row, _, _ = run_policy(policy, model, adapters, traces, args, store)
                runs.append({**row, "repeat": rep})
                print(json.dumps(runs[-1]), flush=True)
    doc = {"kind": "fleet", "model": args.model, "replicas": args.replicas,
           "adapters": args.adapters, "max_loras": args.max_loras,
           "max_cpu_loras": args.max_cpu_loras, "max_num_seqs": args.max_num_seqs,
           "queue_tolerance": args.queue_tolerance, "host_weight": args.host_weight,
           "store": args.store, "disk_cache_mb": args.disk_cache_mb,
           "trace": cfg.describe(),
           "warmup": warm.num_requests, "unseen_in_warmup": len(unseen),
           "repeats": args.repeats, "machine": machine(),
           "runs": runs, "rows": medians(runs, args.policies)}  # fmt: skip
    doc["goals"] = goals(doc["rows"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(table(doc))
    print(goal_lines(doc))
    if not args.no_plot:
        plot(doc, args.out.with_suffix(".png"))
    return doc


METRICS = ("cold_loads", "load_waits", "slot_writes", "ttft_p50_ms", "ttft_p99_ms",
           "output_tok_s", "finished", "requests")  # fmt: skip


def medians(runs: list[dict], policies: list[str]) -> list[dict]:
    rows = []
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        if mine:
            rows.append({"policy": p, **{m: statistics.median(r[m] for r in mine)
                                         for m in METRICS}})  # fmt: skip
            if "store_fetches" in mine[0]:
                rows[-1]["store_fetches"] = statistics.median(r["store_fetches"] for r in mine)
            rows[-1]["max_replica_share"] = statistics.median(max(r["replica_share"])
                                                              for r in mine)  # fmt: skip
    return rows


def goals(rows: list[dict]) -> dict:
    """Issue 26's bar, per affinity policy against round-robin (medians of the repeats)."""
    by = {r["policy"]: r for r in rows}
    rr, out = by.get("round-robin"), {}
    for p in ("affinity", "affinity-host"):
        a = by.get(p)
        if rr is None or a is None:
            continue
        loads = rr["cold_loads"] / max(a["cold_loads"], 1)
        ttft = rr["ttft_p99_ms"] / a["ttft_p99_ms"]
        tput = a["output_tok_s"] / rr["output_tok_s"]
        out[p] = {"cold_loads_x": loads, "ttft_p99_x": ttft, "throughput_ratio": tput,
                  "met": loads >= 5 and ttft >= 2 and tput >= 1.0}  # fmt: skip
    return out


def goal_lines(doc: dict) -> str:
    return "\n".join(
        f"- {p} vs round-robin: cold loads /{g['cold_loads_x']:.1f} (goal ≥ 5), p99 TTFT "
        f"/{g['ttft_p99_x']:.2f} (goal ≥ 2), throughput x{g['throughput_ratio']:.3f} (goal ≥ 1)"
        f" — {'met' if g['met'] else 'not met'}"
        for p, g in doc["goals"].items()
    )


def table(doc: dict) -> str:
    fetches = doc.get("store", "local") != "local"  # a column only where replicas fetch
    head = [
        "policy",
        "cold loads",
        *(["store fetches (mean ms)"] if fetches else []),
        "requests that waited for a load",
        "slot writes",
        "TTFT p50 (ms)",
        "TTFT p99 (ms), runs' range",
        "output tok/s",
        "busiest replica's share",
        "finished",
    ]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in doc["rows"]:
        mine = [x for x in doc["runs"] if x["policy"] == r["policy"]]
        p99 = sorted(x["ttft_p99_ms"] for x in mine)
        spread = f" ({p99[0]:.0f}–{p99[-1]:.0f})" if len(p99) > 1 else ""
        cells = [r["policy"], f"{r['cold_loads']:.0f}"]
        if fetches:
            ms = statistics.median(x["fetch_ms_mean"] for x in mine)
            cells.append(f"{r['store_fetches']:.0f} ({ms:.0f})")
        cells += [f"{r['load_waits']:.0f}", f"{r['slot_writes']:.0f}",
                  f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}{spread}",
                  f"{r['output_tok_s']:.0f}", f"{r['max_replica_share']:.0%}",
                  f"{r['finished']:.0f}/{r['requests']:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    names = [r["policy"] for r in rows]
    xs = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    a.bar(xs, [r["cold_loads"] for r in rows], color="tab:red")
    a.set_ylabel("cold adapter loads (disk -> host)")
    w = 0.4
    b.bar([x - w / 2 for x in xs], [r["ttft_p50_ms"] for r in rows], w, label="p50")
    b.bar([x + w / 2 for x in xs], [r["ttft_p99_ms"] for r in rows], w, label="p99")
    b.set_ylabel("TTFT (ms)")
    b.legend()
    c.bar(xs, [r["output_tok_s"] for r in rows], color="tab:green")
    c.set_ylabel("output tokens/s")
    for ax in (a, b, c):
        ax.set_xticks(list(xs), names, rotation=15)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{doc['replicas']} replicas, {doc['adapters']} adapters (slots "
                 f"{doc['max_loras']}, host {doc['max_cpu_loras']} per replica)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("fleet", adapters=True, plot=not args.no_plot)
    doc = run_fleet(args)
    return 0 if all(r["finished"] == r["requests"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
