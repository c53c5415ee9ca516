"""Interactive TTFT beside a Batch API job, and what the batch adds to the machine's throughput.

    python -m benchmarks.batch_priority [--duration 20] [--rate 1] [--rounds 3]
                                        [--batch-lines 2000] [--concurrency 16]
                                        [--batch-step-tokens 16 32] [--model tiny|demo]

One engine (the real `LLMEngine` on this machine's CPU, tiny random Llama by default) serves a
trace of interactive requests from three tenants (Poisson arrivals, `--rate` per second, for
`--duration` seconds), alone and beside one tenant's batch of `--batch-lines` lines fed as
the server's batch runner feeds them: at most `--concurrency` lines in the engine at a time
(the `batch_concurrency` setting), in the batch class (priority 1) with each
`--batch-step-tokens` as the engine's `max_batch_step_tokens`, once with no such cap (the class
before it had one), and once in the interactive class to show what the class does.

The scenarios run side by side: each of `--rounds` rounds runs every scenario once, in an
order that rotates, on the same arrivals (each round its own); each scenario's prompts have
their own tokens, so none finds another's in the prefix cache. Load from other work on a
shared machine so falls on all of them alike.

Prints and writes (docs/batch-priority.md, docs/batch-priority.png): interactive TTFT p50/p99
over all rounds (from each request's arrival in the trace to its first token) and the
machine's output tokens per second from each trace's start until its last interactive request
is answered (every class).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import PRIORITY_BATCH, PRIORITY_INTERACTIVE

DOCS = Path(__file__).resolve().parent.parent / "docs"
TENANTS = ("alice", "bob", "carol")


@dataclass
class Result:
    name: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    interactive: int
    tokens_per_s: float
    batch_lines_done: int
    batch_steps: list[tuple[float, int]] = field(default_factory=list)


def trace(args, vocab: int, rnd: int, salt: int) -> list[tuple[float, str, list[int]]]:
    """(arrival s, tenant, prompt ids) of round `rnd`: the same arrivals, tenants and prompt
    lengths for every scenario; the prompts' tokens differ by `salt` (the scenario), so no
    scenario finds another's prompts in the prefix cache."""
    rng = random.Random(args.seed * 1000 + rnd)
    words = random.Random(args.seed * 1000 + rnd + 100_000 * (salt + 1))
    t, out = 0.0, []
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return out
        prompt = [words.randrange(3, vocab) for _ in range(rng.randrange(32, 97))]
        out.append((t, rng.choice(TENANTS), prompt))


@dataclass
class Samples:
    """A scenario's measurements, summed over rounds."""

    ttft: list[float]
    tokens: int = 0
    seconds: float = 0.0
    batch_lines_done: int = 0
    # (seconds, batch tokens) of each step that carried batch lines' tokens: what an
    # interactive request arriving during it waits for
    batch_steps: list[tuple[float, int]] = field(default_factory=list)


def run(engine: LLMEngine, args, rnd: int, salt: int, concurrency: int,
        priority: int | None, into: Samples) -> None:  # fmt: skip
    """One round of one scenario; `priority` None: no batch."""
    vocab = engine.vocab_size
    arrivals = trace(args, vocab, rnd, salt)
    rng = random.Random(args.seed * 1000 + rnd + 100_000 * (salt + 1) + 1)
    batch = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.batch_lines)]
    interactive = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    lines = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    finished = 0  # interactive requests
    in_engine: set[str] = set()
    next_line = done_lines = tokens = 0
    i = 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, tenant, prompt = arrivals[i]
            rid = f"i{i}"
            engine.add_request(rid, prompt, interactive, tenant=tenant,
                               priority=PRIORITY_INTERACTIVE)  # fmt: skip
            arrived[rid] = at
            i += 1
        while priority is not None and len(in_engine) < concurrency and next_line < len(batch):
            rid = f"b{next_line}"
            engine.add_request(rid, batch[next_line], lines, tenant="batch", priority=priority)
            in_engine.add(rid)
            next_line += 1
        if not engine.has_unfinished():
            if i >= len(arrivals):
                break
            time.sleep(min(0.005, max(0.0, arrivals[i][0] - now)))
            continue
        started = time.perf_counter()
        outputs = engine.step()
        plan = engine.scheduler.last_plan
        if plan is not None:
            b = sum(n for q, n in zip(plan.seqs, plan.num_new_tokens, strict=True)
                    if q.request_id.startswith("b"))  # fmt: skip
            if b:
                into.batch_steps.append((time.perf_counter() - started, b))
        for out in outputs:
            now = time.perf_counter() - t0
            tokens += len(out.delta_token_ids)
            if out.request_id in arrived and out.request_id not in ttft and out.delta_token_ids:
                ttft[out.request_id] = now - arrived[out.request_id]
            if out.finished and out.request_id in in_engine:
                in_engine.discard(out.request_id)
                done_lines += 1
            elif out.finished and out.request_id in arrived:
                finished += 1
        if i >= len(arrivals) and finished == len(arrivals):
            break  # every interactive request is answered; the rest of the batch is not timed
    elapsed = time.perf_counter() - t0
    for rid in list(in_engine):  # the rest of the batch is not part of this measurement
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    into.ttft += ttft.values()
    into.tokens += tokens
    into.seconds += elapsed
    into.batch_lines_done += done_lines


def summary(name: str, s: Samples) -> Result:
    samples = sorted(s.ttft)

    def q(f: float) -> float:
        return samples[min(len(samples) - 1, int(f * len(samples)))] * 1000

    return Result(name, statistics.median(samples) * 1000, q(0.9), q(0.99), len(samples),
                  s.tokens / s.seconds, s.batch_lines_done, s.batch_steps)  # fmt: skip


def cpu_name() -> str:
    """The CPU's model name and its widest vector extension (x86 Linux), else the machine."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), platform.machine())  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    isa = next((f.upper() for f in ("avx512f", "avx2", "avx") if f in flags), None)
    return f"{name} ({isa})" if isa else name


def model_dir(kind: str) -> str:
    from benchmarks import assets

    return str(assets.tiny_llama() if kind == "tiny" else assets.demo_model())


def write(results: list[Result], args, command: str, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results[0]
    rows = [
        "| scenario | requests | interactive TTFT p50 (ms) | p90 (ms) | p99 (ms) | p50 vs alone "
        "| p99 vs alone | tokens/s (all) | throughput vs alone | batch lines done |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r.name} | {r.interactive} | {r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | "
            f"{r.ttft_p99_ms:.0f} | {r.ttft_p50_ms / base.ttft_p50_ms:.2f}x | "
            f"{r.ttft_p99_ms / base.ttft_p99_ms:.2f}x | {r.tokens_per_s:.0f} | "
            f"{r.tokens_per_s / base.tokens_per_s:.2f}x | {r.batch_lines_done} |"
        )
    rows += [
        "",
        "Steps that carried batch lines' tokens (an interactive request that arrives during "
        "one waits for its end):",
        "",
        "| scenario | steps | ms each, mean | ms, max | batch tokens each, mean | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results[1:]:
        if r.batch_steps:
            ms = [t * 1000 for t, _ in r.batch_steps]
            toks = [n for _, n in r.batch_steps]
            rows.append(f"| {r.name} | {len(ms)} | {statistics.mean(ms):.0f} | {max(ms):.0f} | "
                        f"{statistics.mean(toks):.0f} | {max(toks)} |")  # fmt: skip
    table = "\n".join(rows)
    print(table)
    within = [r.name for r in results[1:] if r.ttft_p99_ms <= 1.1 * base.ttft_p99_ms
              and r.tokens_per_s >= 1.5 * base.tokens_per_s]  # fmt: skip
    verdict = (
        f"In this run, p99 within 1.1x of alone's with at least 1.5x the throughput: "
        f"{', '.join(within) if within else 'none'}."
    )
    DOCS.mkdir(exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r.name for r in results]
    x = range(len(results))
    a.bar([p - 0.2 for p in x], [r.ttft_p50_ms for r in results], 0.4, label="p50")
    a.bar([p + 0.2 for p in x], [r.ttft_p99_ms for r in results], 0.4, label="p99")
    a.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    a.set_ylabel("interactive TTFT (ms)")
    a.legend()
    b.bar(list(x), [r.tokens_per_s for r in results], color="tab:green")
    b.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    b.set_ylabel("output tokens/s, every class")
    fig.suptitle(f"{args.batch_lines}-line batch beside {args.rate}/s interactive ({args.model})")
    fig.tight_layout()
    fig.savefig(DOCS / "batch-priority.png", dpi=110)
    (DOCS / "batch-priority.md").write_text(
        "# Batch API lines beside interactive traffic\n\n"
        "Written by `benchmarks/batch_priority.py` (its docstring says what it runs); the "
        f"command:\n\n    {command}\n\n{machine}\n\n{table}\n\n{verdict}\n\n"
        "TTFT runs from a request's arrival in the trace to its first token; tokens/s counts "
        "every output token the engine made from the trace's start until its last interactive "
        "request was answered, interactive and batch. A batch line in the batch class is "
        "admitted only into seats interactive requests leave free and gives its seat, KV "
        "blocks and adapter slot back first; a step that computes an interactive prompt "
        "carries no batch tokens. What is left is the step an interactive request arrives "
        "during: it waits for that step's end. Without a cap, a wave of batch lines admitted "
        "together (they finish together) made steps of a thousand prompt tokens, hundreds of "
        "milliseconds each; `max_batch_step_tokens` (engine/scheduling/scheduler.py) bounds what a "
        "step gives the batch class, so a step carrying batch work stays short (the second table), "
        "and the batch still fills every step between interactive prompts. The engine's "
        "default is "
        f"{EngineConfig.max_batch_step_tokens} (`max_batch_step_tokens`, engine/options.py): "
        "the smaller the cap, the shorter the wait and the fewer batch tokens a second. "
        "The p99 of a hundred requests is their slowest one or two, and a shared machine's "
        "load moves it by tens of per cent between runs; the rounds interleave the scenarios "
        "so that load falls on each alike, and the p50 shows what a batch step's wait costs a "
        "typical request.\n\n"
        "![TTFT and throughput](batch-priority.png)\n"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of interactive trace")
    p.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16],
                   help="batch lines in the engine at once (batch_concurrency)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="engine threads (torch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every scenario, interleaved")
    p.add_argument("--batch-step-tokens", type=int, nargs="+", default=[16, 32],
                   help="the engine's max_batch_step_tokens, one scenario each")  # fmt: skip
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    config = EngineConfig(model=model_dir(args.model), dtype="float32", max_num_seqs=32,
                          max_model_len=512, scheduling_policy="vtc",
                          num_threads=args.threads)  # fmt: skip
    load = os.getloadavg()[0]
    engine = LLMEngine(config)
    schedule = engine.scheduler.schedule
    engine.scheduler.last_plan = None

    def traced():  # keeps each step's plan for the step statistics
        engine.scheduler.last_plan = plan = schedule()
        return plan

    engine.scheduler.schedule = traced
    warm = SamplingParams(max_tokens=4)
    for k in range(4):  # first steps allocate; keep them out of the measurement
        engine.add_request(f"w{k}", [5 + k] * 40, warm)
    while engine.has_unfinished():
        engine.step()
    c = max(args.concurrency)
    whole = config.max_num_batched_tokens  # no cap of its own: the class as it was before
    scenarios = [("interactive alone", 0, None, whole)]
    scenarios += [(f"+ batch, class, {k} at once, <= {t} tokens/step", k, PRIORITY_BATCH, t)
                  for k in args.concurrency for t in args.batch_step_tokens]  # fmt: skip
    scenarios.append((f"+ batch, class, {c} at once, no step cap", c, PRIORITY_BATCH, whole))
    scenarios.append((f"+ batch, no class, {c} at once", c, PRIORITY_INTERACTIVE, whole))
    # Side by side: every round runs each scenario once (in an order that rotates), so load
    # from other work on a shared machine falls on all of them alike.
    pooled = [Samples([]) for _ in scenarios]
    for rnd in range(args.rounds):
        for k in range(len(scenarios)):
            j = (k + rnd) % len(scenarios)
            _, conc, priority, step_tokens = scenarios[j]
            engine.scheduler.batch_step_tokens = step_tokens
            run(engine, args, rnd, j, conc, priority, pooled[j])
    results = [summary(sc[0], s) for sc, s in zip(scenarios, pooled, strict=True)]
    if args.no_write:
        for r in results:
            print(r)
        return
    import shlex
    import sys

    end = os.getloadavg()[0]
    shared = " (other work shared the machine)" if max(load, end) > 1.5 else ""
    machine = (
        f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, engine threads {args.threads}, "
        f"{args.model} model in float32; load average {load:.1f} at the start and "
        f"{end:.1f} at the end{shared}."
    )
    write(results, args, "python -m benchmarks.batch_priority " + shlex.join(sys.argv[1:]),
          machine)  # fmt: skip


if __name__ == "__main__":
    main()
