"""`python -m benchmarks.speculative`: speculative decoding (prompt lookup) on and off, on the demo
model, at batch 1, 2 and 4.

Goal (issue 27): >= 1.5x tokens/s on a copy-heavy workload, <= 5 % slower where there is
nothing to copy. Workloads, with `ignore_eos` so both sides produce as many tokens:

- copy (greedy: both sides produce the same tokens): each request gives a paragraph of
  held-out prose (testkit/heldout_texts.py) and asks for it again (requests alternate:
  "repeat it word for word", "the corrected text" of a copy with a few words misspelt), the
  answer's first words given, as a base model needs;
- nocopy (sampled, temperature 0.9, top_p 0.95, seeded): open-ended prompts of a few words,
  nothing in them to copy. Sampled, because greedy decoding of this base model falls into
  loops within a few dozen tokens, and a loop is something to copy (measured: greedy
  "nocopy" prompts accepted 79-100 % of the proposals).

Each (workload, batch) runs spec off and on alternately, ABBA (off, on, on, off) per repeat,
on two engines loaded side by side (prefix caching off, so no run reuses another's prompt
KV); tokens/s = generated tokens / wall time of `generate` (prefill included), median per
side. Run from a checkout (it reads the tests' held-out texts):

    python -m benchmarks.speculative --model DATA_DIR/models/gemma-3-270m \
        --out benchmarks/results/speculative-demo.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from loraplex.engine import LLM, SamplingParams

GOAL_COPY, GOAL_NOCOPY = 1.5, 0.95  # speedup on copy-heavy work; the floor where nothing is
OPEN_PROMPTS = [
    "Write a short story about a dragon who learns to cook.\n\n",
    "The most important inventions of the nineteenth century were",
    "Here are some tips for growing tomatoes in a small garden:",
    "Dear diary, today was the strangest day of my life because",
]


def _misspell(text: str) -> str:
    """Every seventh word with two letters swapped: an edit task's input."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) > 3 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def copy_prompts(n: int, chars: int) -> list[str]:
    from testkit.heldout_texts import HELDOUT_TEXTS  # checkout only: the held-out texts

    out = []
    for i in range(n):
        text = HELDOUT_TEXTS[i % len(HELDOUT_TEXTS)][:chars]
        text = text[: text.rfind(". ") + 1] or text  # whole sentences
        head = " ".join(text.split(" ")[:6])
        if i % 2 == 0:
            out.append(f"{text}\n\nThe same text again, word for word:\n\n{head}")
        else:
            out.append(f"Text with spelling mistakes:\n\n{_misspell(text)}\n\n"
                       f"The corrected text:\n\n{head}")  # fmt: skip
    return out


def _run(llm: LLM, prompts: list[str], params) -> dict:
    stats = llm.engine.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts, proposed, accepted = (
        a - b
        for a, b in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens),
            before,
            strict=True,
        )
    )
    n = sum(len(t) for t in tokens)
    return {"tokens": tokens, "generated": n, "seconds": wall, "tok_s": n / wall,
            "drafts": drafts, "proposed": proposed, "accepted": accepted}  # fmt: skip


def measure(off: LLM, on: LLM, prompts: list[str], params, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(repeats):
        for side in ("off", "on", "on", "off"):  # ABBA: drift on the shared machine cancels
            runs[side].append(_run(off if side == "off" else on, prompts, params))
    off_tok_s = statistics.median(r["tok_s"] for r in runs["off"])
    on_tok_s = statistics.median(r["tok_s"] for r in runs["on"])
    proposed = sum(r["proposed"] for r in runs["on"])
    accepted = sum(r["accepted"] for r in runs["on"])
    drafts = sum(r["drafts"] for r in runs["on"])
    steps_tokens = sum(r["generated"] for r in runs["on"])
    greedy = isinstance(params, SamplingParams) and params.greedy
    ref, spec = runs["off"][0]["tokens"], runs["on"][0]["tokens"]
    same = sum(a == b for x, y in zip(ref, spec, strict=True) for a, b in zip(x, y, strict=True))
    return {
        "off_tok_s": off_tok_s,
        "on_tok_s": on_tok_s,
        "speedup": on_tok_s / off_tok_s,
        "off_runs_tok_s": [r["tok_s"] for r in runs["off"]],
        "on_runs_tok_s": [r["tok_s"] for r in runs["on"]],
        "acceptance": accepted / proposed if proposed else None,
        "accepted_per_draft": accepted / drafts if drafts else None,
        # Share of generated tokens that came from a draft (the rest: one per step and request)
        "drafted_share": accepted / steps_tokens if steps_tokens else 0.0,
        # Greedy only (sampled sides draw from different random streams)
        "greedy_agreement": same / sum(len(x) for x in ref) if greedy else None,
    }


def _llm(model: Path, k: int, threads: int, max_model_len: int) -> LLM:
    return LLM(str(model), num_speculative_tokens=k, enable_prefix_caching=False,
               num_threads=threads, max_model_len=max_model_len, max_lora_rank=8,
               max_loras=1)  # fmt: skip


def run(args) -> list[dict]:
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True
    )
    off = _llm(args.model, 0, args.threads, args.max_model_len)
    rows = []
    for k in args.k:
        on = _llm(args.model, k, args.threads, args.max_model_len)
        if args.no_planner:
            on.engine.spec_planner = None  # score every proposal (for comparison)
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for llm in (off, on):
            llm.generate(copy_prompts(1, args.chars), warm)
        for workload in args.workloads:
            for b in args.batches:
                if workload == "copy":
                    prompts, params = copy_prompts(b, args.chars), greedy
                else:
                    prompts = [OPEN_PROMPTS[i % len(OPEN_PROMPTS)] for i in range(b)]
                    params = [dataclasses.replace(sampled, seed=i) for i in range(b)]
                row = {"workload": workload, "batch": b, "k": k, "max_tokens": args.max_tokens,
                       **measure(off, on, prompts, params, args.repeats)}  # fmt: skip
                rows.append(row)
                print(json.dumps({x: v for x, v in row.items() if not x.endswith("runs_tok_s")}),
                      flush=True)  # fmt: skip
        del on
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | batch | k | off tok/s | on tok/s | speedup | goal | acceptance | "
        "accepted / draft | greedy agreement |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        goal = GOAL_COPY if r["workload"] == "copy" else GOAL_NOCOPY
        met = "met" if r["speedup"] >= goal else "missed"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        apd = "-" if r["accepted_per_draft"] is None else f"{r['accepted_per_draft']:.2f}"
        agree = "-" if r["greedy_agreement"] is None else f"{r['greedy_agreement']:.3f}"
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['k']} | {r['off_tok_s']:.1f} | "
            f"{r['on_tok_s']:.1f} | x{r['speedup']:.2f} | >= x{goal} ({met}) | {acc} | {apd} | "
            f"{agree} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    from loraplex.bench.plots import _plt

    plt = _plt()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == w]
        labels = [f"b{r['batch']} k{r['k']}" for r in mine]
        xs = range(len(mine))
        width = 0.4
        for j, (key, name) in enumerate((("off_tok_s", "spec off"), ("on_tok_s", "spec on"))):
            bars = ax.bar([x + (j - 0.5) * width for x in xs], [r[key] for r in mine], width,
                          label=name)  # fmt: skip
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        for x, r in zip(xs, mine, strict=True):
            top = max(r["off_tok_s"], r["on_tok_s"])
            ax.annotate(f"x{r['speedup']:.2f}", (x, top), textcoords="offset points",
                        xytext=(0, 12), ha="center", fontsize=8)  # fmt: skip
        goal = GOAL_COPY if w == "copy" else GOAL_NOCOPY
        ax.set(title=f"{w} (goal x{goal})", ylabel="output tokens/s")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylim(0, 1.25 * max(max(r["off_tok_s"], r["on_tok_s"]) for r in mine))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="converted demo model folder")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--k", type=int, nargs="*", default=[4], help="proposals per step")
    p.add_argument("--workloads", nargs="*", default=["copy", "nocopy"])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--chars", type=int, default=600, help="paragraph length of copy prompts")
    p.add_argument("--repeats", type=int, default=1, help="ABBA cycles per row")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    p.add_argument("--no-planner", action="store_true", help="score every proposal")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative-demo.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = run(args)
    from loraplex.bench.sysinfo import machine

    doc = {"kind": "speculative", "model": str(args.model), "machine": machine(),
           "threads": args.threads, "repeats": args.repeats, "chars": args.chars,
           "planner": not args.no_planner,
           "seconds": time.perf_counter() - start, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(table(rows))


if __name__ == "__main__":
    main()
