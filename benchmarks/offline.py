"""Offline multi-LoRA throughput: loraplex against itself (LoRA overhead) and against peers.

Workload: N prompts of random token ids (seeded lengths), all submitted at once, greedy with
ignore_eos, M output tokens each. Scenarios: base only (engine with LoRA slots, no adapter),
1 adapter, 4 adapters mixed (uniform), K adapters mixed with zipf popularity. Per scenario and
engine: one warm-up run, then --repeats timed runs on fresh prompts; the median counts.
With peers, engines alternate within every repeat (ABBA order) on the same prompts.

    python -m benchmarks.offline --model tiny-llama --peer vllm     # --setup-peer installs vLLM
    python -m benchmarks.offline --model demo --repeats 2
    python -m benchmarks.offline --model demo --ours-opt quantization=int8 --tag int8   # or int4

Writes benchmarks/results/offline-<model>[-<tag>].json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import assets, report
from benchmarks.contention import OthersMeter, settle
from benchmarks.engines import EngineOptions, HFBaseline, Ours
from benchmarks.options import cpu_info, parse_args
from benchmarks.workload import Scenario, make_run, scenarios

QUIET_CORES = 0.3  # others using more than this during a run make it "contended"


def measure(engine, inp, args: argparse.Namespace, label: str) -> dict:
    """One run, repeated (up to --retries times) while other processes took > 0.3 cores."""
    for attempt in range(args.retries + 1):
        before = settle(args.pause, args.wait_quiet, QUIET_CORES)
        with OthersMeter() as during:
            res = engine.run(inp)
        res.update(
            others_cores_before=before, others_cores_during=during.cores, attempt=attempt + 1
        )
        say(
            f"{label} {engine.name:5s} {report.tokens_per_s(res):8.1f} tok/s "
            f"({res['seconds']:.2f} s; others took {before:.1f} cores before, "
            f"{during.cores:.1f} during)"
        )
        if not during.cores > QUIET_CORES:  # NaN (not Linux) counts as quiet
            break
    return res


def make_engine(
    name: str,
    model_dir: Path,
    adapters: list[Path],
    max_loras: int,
    opts: EngineOptions,
    args: argparse.Namespace,
    tag: str,
):
    if name == "ours":
        return Ours(model_dir, adapters, max_loras, opts)
    if name == "hf":
        return HFBaseline(model_dir, adapters, max_loras, opts)
    from benchmarks.peer import VLLMPeer

    log = args.out / f"vllm-worker-{tag}.log"
    return VLLMPeer(
        model_dir,
        adapters,
        max_loras,
        opts,
        venv=args.peer_venv,
        preload=not args.no_peer_preload,
        log=log,
    )


def run_group(
    group: list[Scenario],
    engine_names: list[str],
    model_dir: Path,
    adapters: list[Path],
    vocab: int,
    opts: EngineOptions,
    args: argparse.Namespace,
    tag: str,
    results: dict,
) -> None:
    """Scenarios sharing one engine configuration (adapter slots): build, measure, close."""
    max_loras = group[0].max_loras
    need = max(sc.num_adapters for sc in group)
    say(f"building engines {engine_names} (max_loras={max_loras}, {need} adapters)")
    engines = {}
    try:
        for name in engine_names:
            engines[name] = make_engine(
                name, model_dir, adapters[:need], max_loras, opts, args, tag
            )
            results["init_s"][f"{name}/max_loras={max_loras}"] = engines[name].init_s
            if name == "ours":
                from loraplex.engine.weights.quantization import resident_weight_bytes

                results["meta"]["ours_compute_dtype"] = engines[name].compute_dtype
                weights = resident_weight_bytes(engines[name].llm.engine.model)
                results["meta"]["ours_weight_bytes"] = weights
                say(f"ours: {weights / 2**20:.0f} MiB of resident weights")
            if name == "vllm":
                results["meta"]["vllm_version"] = engines[name].version
                results["meta"]["vllm_preload"] = engines[name].preload
        for sc in group:
            entry = {
                "name": sc.name,
                "label": sc.label,
                "num_adapters": sc.num_adapters,
                "popularity": sc.popularity,
                "max_loras": sc.max_loras,
                "engines": {e: {"runs": []} for e in engine_names},
            }
            for run in range(-1, args.repeats):  # run -1: warm-up
                inp = make_run(
                    sc,
                    run,
                    num_prompts=args.num_prompts,
                    min_len=args.prompt_len[0],
                    max_len=args.prompt_len[1],
                    vocab_size=vocab,
                    zipf_alpha=args.zipf_alpha,
                    seed=args.seed,
                )
                if run == -1:
                    entry["distinct_adapters_per_run"] = []
                entry["distinct_adapters_per_run"].append(
                    len({a for a in inp.adapters if a is not None})
                )
                order = engine_names if run % 2 else engine_names[::-1]
                what = "warm-up" if run < 0 else f"run {run + 1}/{args.repeats}"
                for name in order:
                    if run < 0:  # warm-ups are not retried
                        res = engines[name].run(inp)
                        entry["engines"][name]["warmup_s"] = res["seconds"]
                        say(f"[{sc.name}] {what} {name:5s} {res['seconds']:.2f} s")
                        continue
                    res = measure(engines[name], inp, args, f"[{sc.name}] {what}")
                    entry["engines"][name]["runs"].append(res)
            results["scenarios"].append(entry)
    finally:
        for eng in engines.values():
            eng.close()


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.setup_peer:
        from benchmarks.peer import setup_peer

        setup_peer(args.peer_venv)
    chosen = {s.strip() for s in args.scenarios.split(",")} | {"base"}
    all_sc = scenarios(args.num_adapters, args.zipf_max_loras, args.max_loras)
    scs = [sc for sc in all_sc if sc.name in chosen or sc.popularity in chosen]
    need = max(sc.num_adapters for sc in scs)
    say(f"preparing {args.model} and {need} adapters")
    model_dir, adapters = assets.prepare(
        args.model, max(need, 1), rank=args.lora_rank, init_std=args.adapter_std
    )
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    opts = EngineOptions(
        dtype=args.dtype,
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_tokens=args.max_tokens,
        hf_prompts=args.hf_prompts,
        peer_dtype=args.peer_dtype,
        ours_extra=tuple(args.ours_opt),
    )
    model_name = args.model if args.model in ("tiny-llama", "demo") else model_dir.name
    tag = model_name + (f"-{args.tag}" if args.tag else "")
    import torch

    results = {
        "meta": {
            "model": model_name,
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "peer_dtype": args.peer_dtype or args.dtype,
            "ours_opts": dict(args.ours_opt),
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "seed": args.seed,
            "zipf_alpha": args.zipf_alpha,
            "max_loras": args.max_loras,
            "zipf_max_loras": args.zipf_max_loras,
            "max_lora_rank": args.max_lora_rank,
            "adapters": [str(p) for p in adapters],
            "lora_rank": args.lora_rank,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu": cpu_info(),
            "loadavg_start": os.getloadavg(),
            "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "engines": ["ours", *args.peer],
        "init_s": {},
        "scenarios": [],
    }
    groups: dict[int, list[Scenario]] = {}
    for sc in scs:
        groups.setdefault(sc.max_loras, []).append(sc)
    for group in groups.values():
        run_group(group, results["engines"], model_dir, adapters, vocab, opts, args, tag, results)
    results["meta"]["loadavg_end"] = os.getloadavg()
    report.summarize(results)
    for sc in results["scenarios"]:
        for entry in sc["engines"].values():
            for r in entry["runs"]:
                r.pop("token_ids", None)
                r["tokens_per_s"] = report.tokens_per_s(r)
        sc["distinct_adapters_median"] = statistics.median(sc["distinct_adapters_per_run"])
    text = report.table(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"offline-{tag}.json", args.out / f"offline-{tag}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    report.chart(results, png_path)
    say(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
