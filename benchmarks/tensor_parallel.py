"""Tensor parallelism on the CPU: TP = 2 with one thread per rank against TP = 1 with two
threads (issue 58), on the same model and options.

For each batch size, `batch` requests of `--prompt-len` tokens are prefilled, then `--steps`
decode steps are timed one by one: decode tok/s (batch / mean step time) and ITL (the median
step). Each engine also reports its KV pool under the same `--kv-cache-mib` per rank (blocks
and bytes per token) and, at TP = 2, the bytes its group moved per decode step: the plan rank
0 broadcasts and the all-reduces' payload. `--adapter` runs every row on one adapter (its
slot write crosses once, with the first step). Prints a table; writes a JSON and a PNG.

    python -m benchmarks.tensor_parallel --model demo --batches 1 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="'demo' (Gemma 3 270M), 'tiny-llama' or a model folder")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where 'demo' is converted (default cache)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per batch")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--kv-cache-mib", type=int, default=64, help="KV pool per rank")
    p.add_argument("--threads", type=int, default=2, help="TP = 1's threads; TP = 2: 1 each")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="every row on one generated adapter of this rank (0: the base alone)",
    )
    p.add_argument("--out", default=str(RESULTS / "tensor-parallel.json"))
    p.add_argument("--png", default=None, help="the chart (default: beside --out)")
    p.add_argument("--no-plot", action="store_true")


def _decode(engine, batch: int, prompt_len: int, steps: int, lora) -> dict:
    from loraplex.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 10 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params, lora_request=lora)
    while any(not r.samples[0].seq.output_token_ids for r in engine.requests.values()):
        engine.step()  # prefill (and the first token)
    tp = getattr(engine.runner, "tp", None)
    sent0 = (tp.group.bytes_broadcast, tp.group.bytes_reduced) if tp else (0, 0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    sent = (
        (tp.group.bytes_broadcast - sent0[0], tp.group.bytes_reduced - sent0[1]) if tp else (0, 0)
    )
    while engine.has_unfinished():
        engine.step()
    engine.requests.clear()
    mean = statistics.fmean(times)
    return {
        "batch": batch,
        "decode_tok_s": batch / mean,
        "itl_ms": statistics.median(times) * 1e3,
        "plan_bytes_per_step": sent[0] / steps,
        "reduce_bytes_per_step": sent[1] / steps,
    }


def run(args: argparse.Namespace) -> dict:
    from benchmarks import assets
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm import resolve_model
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.sequence import LoRARequest
    from loraplex.engine.step.model_runner import kv_block_bytes

    if args.model == "tiny-llama":
        model = str(assets.tiny_llama())
    else:
        model = resolve_model(args.model, Path(args.data_dir) if args.data_dir else None)
    lora = None
    if args.lora_rank:
        name = Path(model).name
        folder = assets.make_adapters(Path(model), name, 1, rank=args.lora_rank)[0]
        lora = LoRARequest("bench", 1, str(folder))
    rows = []
    # TP = 1 with one thread too: on a loaded machine two threads can lose more to each
    # other than they gain, and the one-thread row says how much
    for tp, threads in ((1, args.threads), (1, 1), (2, 1)):
        config = EngineConfig(
            model=model, tensor_parallel_size=tp, num_threads=threads,
            kv_cache_bytes=args.kv_cache_mib << 20, max_model_len=args.prompt_len + args.steps + 16,
            max_num_seqs=max(args.batches), enable_lora=lora is not None, max_loras=1,
            max_lora_rank=max(args.lora_rank, 1), cpu_attention="sdpa",
        )  # fmt: skip
        engine = LLMEngine(config)
        try:
            runner = engine.runner
            block = kv_block_bytes(engine.model, config.block_size)  # this rank's share
            kv = {"kv_blocks": runner.num_blocks, "kv_bytes_per_token": block // config.block_size,
                  "kv_budget_blocks": config.kv_cache_bytes // block}  # fmt: skip
            for batch in args.batches:
                r = _decode(engine, batch, args.prompt_len, args.steps, lora)
                rows.append({"tp": tp, "threads_per_rank": threads, **kv, **r})
                print(f"TP={tp} x{threads} thread(s) batch {batch}: {r['decode_tok_s']:.1f} tok/s, "
                      f"ITL {r['itl_ms']:.1f} ms, plan {r['plan_bytes_per_step']:.0f} B/step, "
                      f"all-reduce {r['reduce_bytes_per_step']:.0f} B/step, "
                      f"KV {kv['kv_bytes_per_token']} B/token/rank", flush=True)  # fmt: skip
        finally:
            engine.close()
    spec = engine.model.full_spec if hasattr(engine.model, "full_spec") else engine.model.spec
    return {"model": args.model, "layers": spec.num_layers, "hidden": spec.hidden_size,
            "kv_heads": spec.num_kv_heads, "prompt_len": args.prompt_len,
            "kv_cache_mib": args.kv_cache_mib,
            "steps": args.steps, "lora_rank": args.lora_rank, "rows": rows}  # fmt: skip


def table(doc: dict) -> str:
    lines = [
        "| TP | threads/rank | batch | decode tok/s | ITL ms | KV B/token/rank | KV blocks "
        f"in {doc['kv_cache_mib']} MiB/rank | plan B/step | all-reduce B/step/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['tp']} | {r['threads_per_rank']} | {r['batch']} | "
            f"{r['decode_tok_s']:.1f} | {r['itl_ms']:.1f} | {r['kv_bytes_per_token']} | "
            f"{r['kv_budget_blocks']} | "
            f"{r['plan_bytes_per_step']:.0f} | {r['reduce_bytes_per_step']:.0f} |"
        )
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    batches = sorted({r["batch"] for r in doc["rows"]})
    systems = list(dict.fromkeys((r["tp"], r["threads_per_rank"]) for r in doc["rows"]))
    width = 0.8 / len(systems)
    for k, (tp, threads) in enumerate(systems):
        rows = {r["batch"]: r for r in doc["rows"]
                if (r["tp"], r["threads_per_rank"]) == (tp, threads)}  # fmt: skip
        label = f"TP={tp}, {threads} thread{'s' if threads > 1 else ''}" + (
            "/rank" if tp > 1 else ""
        )
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(batches))]
        a.bar(xs, [rows[b]["decode_tok_s"] for b in batches], width, label=label)
        b.bar(xs, [rows[b]["itl_ms"] for b in batches], width, label=label)
    for ax, ylabel in ((a, "decode tok/s"), (b, "ITL (median step, ms)")):
        ax.set_xticks(range(len(batches)), [f"batch {x}" for x in batches])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"tensor parallelism on the CPU ({doc['model']}, loaded machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("tensor_parallel", adapters=args.lora_rank > 0, plot=not args.no_plot)
    doc = run(args)
    print(table(doc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    if not args.no_plot:
        print("wrote", plot(doc, Path(args.png) if args.png else out.with_suffix(".png")))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
