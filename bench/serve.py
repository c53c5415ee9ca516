"""`loraplex bench serve`: a seeded trace replayed against any OpenAI-compatible server.

    loraplex bench serve --url http://127.0.0.1:8000 --api-key $KEY --num-adapters 4 \
        --rate 8 --num-requests 200 --input-len 8:256 --output-len 8:128 --slo-ttft-ms 500

Each run prints a summary and writes serve[-<tag>].json (+ .png) into --out, by default
`<data dir>/bench-results` (LORAPLEX_DATA_DIR). The trace options and the report are shared
with the checkout's lab (benchmarks/: the same trace against our engine in-process, adapter
count scaling, peers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from loraplex.bench.metrics import SLO, RequestResult, format_summary, summarize
from loraplex.bench.trace import LengthDist, TraceConfig, make_trace


def default_out() -> Path:
    """Where results go when --out is not given: under the data dir of the current settings
    (LORAPLEX_DATA_DIR, LORAPLEX_CONFIG), never inside the installed package."""
    from loraplex.platform.settings import Settings

    return Settings().data_dir / "bench-results"


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
    s.add_argument("--out", type=Path, default=None,
                   help="folder for JSON and PNG (default: <data dir>/bench-results)")  # fmt: skip
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
    import httpx

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
    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    written = [path]
    if not args.no_plot:
        from loraplex.bench.plots import plot_run

        written.append(plot_run(doc, out / f"{name}.png"))
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
