"""`loraplex bench serve` (a trace against an OpenAI-compatible server) and `bench offline`
(the same trace against our engine in-process, no HTTP).

    loraplex bench serve --url http://127.0.0.1:8000 --api-key $KEY --num-adapters 4 \
        --rate 8 --num-requests 200 --input-len 8:256 --output-len 8:128 --slo-ttft-ms 500
    loraplex bench offline --model tiny-llama --num-adapters 64 --rate inf

Each run prints a summary and writes bench/results/serve-<tag>.json or engine-<tag>.json
(+ .png); bench/offline.py's own results are offline-*.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import httpx

from loraplex.bench.metrics import SLO, RequestResult, format_summary, summarize
from loraplex.bench.trace import LengthDist, TraceConfig, make_trace

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--num-requests", type=int, default=100)
    g.add_argument("--rate", type=float, default=4.0, help="requests/s; inf: all at once")
    g.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    g.add_argument("--cv", type=float, default=1.0, help="coefficient of variation (gamma)")
    g.add_argument("--num-adapters", type=int, default=4, help="0: base model only")
    g.add_argument("--alpha", type=float, default=1.0, help="power-law popularity exponent")
    g.add_argument("--base-fraction", type=float, default=0.0, help="share sent to the base")
    g.add_argument(
        "--input-len",
        type=LengthDist.parse,
        default=LengthDist(8, 256),
        help="N (fixed) or LOW:HIGH (uniform)",
    )
    g.add_argument(
        "--output-len",
        type=LengthDist.parse,
        default=LengthDist(8, 128),
        help="N (fixed) or LOW:HIGH (uniform)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt ids are drawn below this (default: the model's, else 32000)",
    )
    g.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("report")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    s.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (default: open loop, none)",
    )
    s.add_argument("--tag", default="", help="suffix of the output file names")
    s.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for JSON and PNG")
    s.add_argument("--no-plot", action="store_true")
    s.add_argument("--no-progress", action="store_true")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LORAPLEX_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $LORAPLEX_API_KEY or $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--adapter-names",
        default=None,
        help="comma-separated model names for adapters 0..N-1 (default: the "
        "server's /v1/models after the base model)",
    )
    p.add_argument("--base-model", default=None, help="default: first of /v1/models")
    p.add_argument("--model-dir", type=Path, default=None, help="for the vocabulary size")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="for servers that refuse the ignore_eos extension",
    )
    add_trace_args(p)


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-loras", type=int, default=8, help="adapter slots in the batch")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host LRU of adapters")
    p.add_argument("--max-lora-rank", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the generated adapters")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_trace_args(p)


def trace_config(args: argparse.Namespace, vocab_size: int | None) -> TraceConfig:
    return TraceConfig(
        num_requests=args.num_requests,
        rate=args.rate,
        arrival=args.arrival,
        cv=args.cv,
        num_adapters=args.num_adapters,
        alpha=args.alpha,
        base_fraction=args.base_fraction,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=args.vocab_size or vocab_size or 32000,
        seed=args.seed,
    )


def model_vocab(model_dir: Path) -> int | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except OSError:
        return None
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def discover_models(url: str, api_key: str | None) -> list[str]:
    """Model ids of /v1/models, base model first (as loraplex and vLLM list them)."""
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
    if resp.status_code != 200:
        raise SystemExit(f"GET {base}/v1/models: HTTP {resp.status_code} {resp.text[:200]}")
    return [m["id"] for m in resp.json()["data"]]


def slo_of(args: argparse.Namespace) -> SLO:
    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000

    return SLO(s(args.slo_ttft_ms), s(args.slo_tpot_ms), s(args.slo_e2e_ms))


def report(
    kind: str,
    target: dict,
    cfg: TraceConfig,
    results: list[RequestResult],
    args: argparse.Namespace,
) -> dict:
    """Summarise, print, write JSON (+ PNG); returns the JSON object."""
    from loraplex.bench.sysinfo import machine

    summary = summarize(results, slo_of(args))
    doc = {
        "kind": kind,
        "target": target,
        "trace": {
            **cfg.__dict__,
            "input_len": str(cfg.input_len),
            "output_len": str(cfg.output_len),
            "description": cfg.describe(),
        },
        "machine": machine(),
        "argv": sys.argv,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "summary": summary,
        "requests": [r.to_json() for r in results],
    }
    if math.isinf(cfg.rate):
        doc["trace"]["rate"] = "inf"  # JSON has no infinity
    print(f"{kind}: {cfg.describe()}")
    print(format_summary(summary))
    name = kind + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    written = [path]
    if not args.no_plot:
        from loraplex.bench.plots import plot_run

        written.append(plot_run(doc, args.out / f"{name}.png"))
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return doc


def run_serve(args: argparse.Namespace) -> dict:
    from loraplex.bench.replay import run_replay
    from loraplex.bench.targets import HTTPTarget

    vocab = model_vocab(args.model_dir) if args.model_dir else None
    cfg = trace_config(args, vocab)
    names = args.adapter_names.split(",") if args.adapter_names else None
    base = args.base_model
    if names is None or base is None:
        listed = discover_models(args.url, args.api_key)
        base = base or listed[0]
        names = names or [m for m in listed if m != base]
    if cfg.base_fraction < 1 and len(names) < cfg.num_adapters:
        raise SystemExit(
            f"--num-adapters {cfg.num_adapters} but the server offers {len(names)} adapters "
            f"({', '.join(names[:5])}…); register more or lower --num-adapters"
        )
    target = HTTPTarget(args.url, args.api_key, names, base, ignore_eos=not args.no_ignore_eos)
    results = run_replay(
        target,
        make_trace(cfg),
        max_concurrency=args.max_concurrency,
        progress=not args.no_progress,
        desc="bench serve",
    )
    info = {"url": args.url, "base_model": base, "adapters": names[: cfg.num_adapters]}
    return report("serve", info, cfg, results, args)


def run_offline(args: argparse.Namespace) -> dict:
    from loraplex.bench import assets
    from loraplex.bench.replay import run_replay
    from loraplex.bench.targets import EngineTarget

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_dir, adapters = assets.prepare(args.model, max(args.num_adapters, 1), rank=args.lora_rank)
    cfg = trace_config(args, model_vocab(model_dir))
    target = EngineTarget.build(
        model_dir,
        adapters[: args.num_adapters],
        dtype=args.dtype,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    results = run_replay(
        target,
        make_trace(cfg),
        max_concurrency=args.max_concurrency,
        progress=not args.no_progress,
        desc="bench offline",
    )
    info = {
        "engine": "loraplex (in-process)",
        "model": str(model_dir),
        "dtype": args.dtype,
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "threads": args.threads,
    }
    return report("engine", info, cfg, results, args)  # offline.py owns "offline-*"
