"""`python -m benchmarks.long_outputs`: long outputs through the engine process — bytes per step
message and tokens/s against the offline `LLM` doing the same work.

One tiny random Llama (testkit/factories), `--concurrency` requests of `--tokens` greedy
tokens each (ignore_eos). Prints the bytes the engine process sent the server per step
(median around token 100 and around token `--late`; a step message carries every running
request's output, and now and then a stats snapshot, hence medians; a message that covers k
fast steps merged counts as k steps of 1/k of its bytes), taken from a run with one message
per step (engine_process.COALESCE_S off: the delta protocol's own size), and generated
tokens/s through `EngineProcess` as `loraplex serve` runs it (steps under COALESCE_S merged)
and with one message per step, against the offline `LLM` doing the same work (`--repeats`
alternates the three, ABC CBA, and takes each one's median: the machine is shared).

    python -m benchmarks.long_outputs                  # 1 request x 4,096 tokens
    python -m benchmarks.long_outputs --tokens 8192 --late 8000
    python -m benchmarks.long_outputs --concurrency 8
    python -m benchmarks.long_outputs --cases issue    # 1 x 8,192 and 8 x 4,096, one run

From the checkout's root. The tiny model is built with the
checkout's tests/utils (as `--model tiny-llama` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _context(tokens: int) -> int:
    return -(-(len(PROMPT) + tokens) // 64) * 64  # the prompt and every token fit


def _offline(model: str, n: int, tokens: int, threads: int) -> float:
    from loraplex.engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", num_threads=threads, max_model_len=_context(tokens))
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * n, params)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return n * tokens / seconds


def _served(
    model: str, n: int, tokens: int, threads: int, coalesce_s: float | None = None
) -> tuple[float, list[float], int]:
    """(tokens/s, bytes per step, messages); coalesce_s: None as `loraplex serve` runs it."""
    from loraplex.engine import EngineConfig, SamplingParams
    from loraplex.engine.process.engine_process import EngineProcess

    config = EngineConfig(
        model, dtype="float32", num_threads=threads, max_model_len=_context(tokens)
    )
    engine = EngineProcess(config, **({} if coalesce_s is None else {"coalesce_s": coalesce_s}))

    async def one(max_tokens: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        last = None
        async for out in engine.generate(PROMPT, params):
            last = out
        return len(last.outputs[0].token_ids)

    async def run(max_tokens: int) -> list[int]:
        return await asyncio.gather(*(one(max_tokens) for _ in range(n)))

    try:
        asyncio.run(run(16))
        engine.step_bytes.clear()
        t0 = time.perf_counter()
        counts = asyncio.run(run(tokens))
        seconds = time.perf_counter() - t0
        assert counts == [tokens] * n, counts
        # Bytes per step: a message covering k merged steps counts as k steps of 1/k of its
        # bytes, so index k still holds step k's share.
        sizes = [size / steps for size, steps in engine.step_bytes for _ in range(steps)]
        return n * tokens / seconds, sizes, len(engine.step_bytes)
    finally:
        engine.shutdown()


def _around(sizes: list[float], token: int, width: int = 10) -> float:
    """Median bytes per step around token `token` (+- width) of each request: step k carries
    token k + 1 (the prompt's prefill step yields the first token)."""
    return statistics.median(sizes[max(0, token - 1 - width) : token + width])


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=4096, help="tokens each request generates")
    ap.add_argument("--concurrency", type=int, default=1, help="requests at once")
    ap.add_argument("--early", type=int, default=100, help="token the early bytes are taken at")
    ap.add_argument("--late", type=int, default=4000, help="token the late bytes are taken at")
    ap.add_argument("--repeats", type=int, default=1, help="served/offline pairs, ABBA order")
    ap.add_argument(
        "--cases", choices=("one", "issue"), default="one",
        help="one: the case above; issue: 1 x 8,192 and 8 x 4,096 tokens (late at 8,000 / 4,000)",
    )  # fmt: skip
    ap.add_argument(
        "--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
        help="torch threads of the engine, both sides (default: as `loraplex serve`, all "
        "cores but one, which the server's own work keeps)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="write the figures as JSON here")


def _case(model: str, n: int, tokens: int, early: int, late: int, repeats: int,
          threads: int) -> dict:  # fmt: skip
    from loraplex.engine.process.engine_process import COALESCE_S

    runs: dict[str, list[float]] = {"served": [], "per_step": [], "offline": []}
    for i in range(repeats):
        order = ("served", "per_step", "offline")
        for which in order if i % 2 == 0 else order[::-1]:
            if which == "offline":
                runs["offline"].append(_offline(model, n, tokens, threads))
            elif which == "served":
                rate, _, messages = _served(model, n, tokens, threads)
                runs["served"].append(rate)
            else:  # one message per step: the delta protocol's bytes per step
                rate, sizes, _ = _served(model, n, tokens, threads, coalesce_s=0.0)
                runs["per_step"].append(rate)
    served, per_step, offline = (statistics.median(runs[k]) for k in runs)
    e, la = _around(sizes, early), _around(sizes, late)
    print(f"work: {n} request(s) x {tokens} tokens, tiny random llama, float32, greedy, "
          f"ignore_eos, {threads} engine thread(s)")  # fmt: skip
    print("one message per step (coalescing off):")
    print(f"  engine -> server bytes per step at token {early}: {e:,.0f}")
    print(f"  engine -> server bytes per step at token {late}: {la:,.0f}")
    print(f"  ratio late/early: {la / e:.2f}  (goal <= 1.2)")
    print(f"  all step messages: {sum(sizes):,.0f} bytes in {len(sizes)} messages")
    print(f"  tokens/s through the engine process: {per_step:,.1f}"
          f"  (ratio to offline {per_step / offline:.2f})")  # fmt: skip
    print(f"as `loraplex serve` runs it (steps under {COALESCE_S * 1e3:g} ms merged: "
          f"{messages} messages for {tokens} steps):")  # fmt: skip
    print(f"  tokens/s through the engine process: {served:,.1f}")
    print(f"tokens/s through the offline LLM:    {offline:,.1f}")
    print(f"  ratio served/offline: {served / offline:.2f}  (goal >= 0.9)")
    if repeats > 1:
        print("  runs: " + ", ".join(f"{k} {[round(r, 1) for r in v]}" for k, v in runs.items()))
    return {
        "requests": n, "tokens": tokens, "threads": threads,
        "early_token": early, "late_token": late,
        "bytes_early": e, "bytes_late": la, "bytes_ratio": la / e,
        "served_tok_s": served, "offline_tok_s": offline, "served_over_offline": served / offline,
        "per_step_tok_s": per_step, "per_step_over_offline": per_step / offline,
        "coalesce_s": COALESCE_S, "served_messages": messages,
        "served_runs": runs["served"], "per_step_runs": runs["per_step"],
        "offline_runs": runs["offline"],
    }  # fmt: skip


def run_long(args: argparse.Namespace) -> dict:
    if args.cases == "issue":
        cases = [(1, 8192, args.early, 8000), (8, 4096, args.early, 4000)]
    else:
        assert args.early < args.late < args.tokens, "need early < late < tokens"
        cases = [(args.concurrency, args.tokens, args.early, args.late)]

    from benchmarks.assets import factories
    from loraplex.bench.sysinfo import machine

    make_tiny_model = factories().make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(t for _, t, _, _ in cases)
        model = str(
            make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=longest + 64)
        )
        for n, tokens, early, late in cases:
            rows.append(_case(model, n, tokens, early, late, args.repeats, args.threads))
    doc = {"bench": "long", "machine": machine(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def section(doc: dict, path: Path, out: Path) -> str:
    """docs/benchmarks.md's section for one results file (`python -m benchmarks.docs`)."""
    rows = doc["rows"]
    head = f"### `{path.name}`: tiny random llama, float32, greedy, ignore_eos"
    text = (
        f"{head}\n\n"
        "Generated tokens/s through `EngineProcess` (as `loraplex serve` runs it: steps under "
        "`COALESCE_S` go to the server in one message; and with one message per step) over "
        "the offline `LLM` doing the same work; the three alternate (ABC CBA), medians of "
        f"{len(rows[0]['served_runs'])} run(s) each. Bytes: engine -> server per step with "
        "one message per step, around the early and the late token.\n\n"
    )
    if doc.get("command"):  # files written before the lab left the package name the old CLI
        command = doc["command"].replace("loraplex bench long", "python -m benchmarks.long_outputs")
        text += f"`{command}`\n\n"
    table = [
        "| case | served / offline | one message per step / offline | served tok/s "
        "| offline tok/s | messages (served) | bytes per step, early / late |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['requests']} x {r['tokens']:,} tokens | {r['served_over_offline']:.2f} "
            f"| {r['per_step_over_offline']:.2f} | {r['served_tok_s']:,.0f} "
            f"| {r['offline_tok_s']:,.0f} | {r['served_messages']:,} "
            f"| {r['bytes_early']:,.0f} / {r['bytes_late']:,.0f} |"
        )
    text += "\n".join(table) + "\n"
    runs = "".join(
        f"- {r['requests']} x {r['tokens']:,}: served {[round(x) for x in r['served_runs']]}, "
        f"per step {[round(x) for x in r['per_step_runs']]}, "
        f"offline {[round(x) for x in r['offline_runs']]} tok/s\n"
        for r in rows
    )
    notes = "".join(f"- {n}\n" for n in doc.get("notes", []))
    return text + "\nRuns:\n\n" + runs + (f"\n{notes}" if notes else "")


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser

    run_long(parser(__doc__, add_args).parse_args(argv))


if __name__ == "__main__":
    main()
