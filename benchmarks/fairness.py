"""FCFS vs VTC for a heavy and a light tenant, on the real scheduler without a model.

    python -m benchmarks.fairness [--steps 4000] [--heavy-rate 0.5] [--light-rate 0.03]

The heavy tenant sends more than the engine can serve (its queue grows without end); the
light one sends a trickle, well under its fair share. Both run through the real `Scheduler` +
`BlockManager` + policy, stepped without a model (each sampled token is a fake id), so time is
counted in engine steps. Prints per-tenant token shares per window and TTFT percentiles (in
steps), writes `results/fairness.json` and `results/fairness.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from collections import defaultdict
from pathlib import Path

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence

RESULTS = Path(__file__).parent / "results"
TENANTS = ("heavy", "light")


def simulate(policy: str, args: argparse.Namespace, model_dir: str) -> dict:
    config = EngineConfig(
        model=model_dir,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        scheduling_policy=policy,
    )
    sched = Scheduler(config, BlockManager(args.kv_blocks, 16, False))
    rng = random.Random(args.seed)
    rates = {"heavy": args.heavy_rate, "light": args.light_rate}
    arrived: dict[int, tuple[str, int]] = {}  # seq_no -> (tenant, arrival step)
    ttft: dict[str, list[int]] = defaultdict(list)
    window: dict[str, float] = defaultdict(float)
    shares: list[dict[str, float]] = []
    seen: set[int] = set()
    for step in range(args.steps):
        for tenant, rate in rates.items():
            # Poisson arrivals per step (counts above 3 are folded into 3).
            for _ in range(rng.choices([0, 1, 2, 3], weights=_poisson(rate))[0]):
                seq = Sequence(
                    f"{tenant}-{step}-{len(arrived)}",
                    [rng.randrange(1, 30000) for _ in range(rng.randint(32, 96))],
                    SamplingParams(max_tokens=rng.randint(32, 96), ignore_eos=True),
                    tenant=tenant,
                    arrival=float(step),
                )
                arrived[seq.seq_no] = (tenant, step)
                sched.add(seq)
        out = sched.schedule()
        for seq in out.seqs:
            if seq.seq_no not in seen:
                seen.add(seq.seq_no)
                window[seq.tenant] += seq.num_prompt_tokens
        sampled = {s.seq_no: 7 for i, s in enumerate(out.seqs) if out.samples(i)}
        for seq in sched.postprocess(out, sampled):
            window[seq.tenant] += 1
            if len(seq.output_token_ids) == 1:
                ttft[seq.tenant].append(step - arrived[seq.seq_no][1])
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        if (step + 1) % args.window == 0:
            total = sum(window.values()) or 1.0
            shares.append({t: window[t] / total for t in TENANTS})
            window.clear()
    waiting = defaultdict(int)
    for seq in sched.waiting:
        waiting[seq.tenant] += 1
    return {
        "policy": policy,
        "shares": shares,
        "ttft_steps": {t: _percentiles(ttft[t]) for t in TENANTS},
        "served_requests": {t: len(ttft[t]) for t in TENANTS},
        "waiting_at_end": {t: waiting[t] for t in TENANTS},
    }


def _poisson(rate: float) -> list[float]:
    p = [math.exp(-rate) * rate**k / math.factorial(k) for k in range(3)]
    return [*p, max(0.0, 1.0 - sum(p))]


def _percentiles(values: list[int]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "n": 0}
    v = sorted(values)
    pick = lambda q: float(v[min(len(v) - 1, int(q * len(v)))])  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "n": len(v)}


def report(results: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{'policy':6} {'tenant':6} {'share':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
        f"{'served':>7} {'queued':>7}   (TTFT in engine steps)"
    )
    for r in results:
        for t in TENANTS:
            share = sum(s[t] for s in r["shares"]) / max(1, len(r["shares"]))
            q = r["ttft_steps"][t]
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            print(
                f"{r['policy']:6} {t:6} {share:6.3f} {fmt(q['p50']):>9} {fmt(q['p90']):>7} "
                f"{fmt(q['p99']):>7} {r['served_requests'][t]:>7} {r['waiting_at_end'][t]:>7}"
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r, style in zip(results, ("-", "--"), strict=True):
        xs = [(i + 1) * args.window for i in range(len(r["shares"]))]
        for t, color in (("heavy", "tab:red"), ("light", "tab:blue")):
            ax1.plot(
                xs, [s[t] for s in r["shares"]], style, color=color, label=f"{r['policy']} {t}"
            )
    ax1.set(
        xlabel="engine step",
        ylabel=f"token share per {args.window} steps",
        title="per-tenant share over time",
    )
    ax1.legend()
    labels, width = ["p50", "p90", "p99"], 0.2
    for k, (r, t) in enumerate((r, t) for r in results for t in TENANTS):
        vals = [r["ttft_steps"][t][q] or 0 for q in labels]
        ax2.bar([i + (k - 1.5) * width for i in range(3)], vals, width, label=f"{r['policy']} {t}")
    ax2.set_xticks(range(3), labels)
    ax2.set(ylabel="TTFT (engine steps)", title="time to first token", yscale="log")
    ax2.legend()
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / "fairness.png", dpi=120)
    (RESULTS / "fairness.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )
    print(f"\nwrote {RESULTS / 'fairness.json'} and {RESULTS / 'fairness.png'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--window", type=int, default=200, help="steps per share sample")
    p.add_argument("--heavy-rate", type=float, default=0.5, help="requests per step")
    p.add_argument("--light-rate", type=float, default=0.03, help="requests per step")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        # EngineConfig only reads config.json: the scheduler needs no weights.
        (Path(d) / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
        results = [simulate(policy, args, d) for policy in ("fcfs", "vtc")]
    report(results, args)


if __name__ == "__main__":
    main()
