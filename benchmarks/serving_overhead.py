"""`python -m benchmarks.serving_overhead`: what the server adds between the engine and the
socket, split by stage and tabled against the same engine offline (issue 60).

Two cases on the tiny random Llama (float32, greedy, ignore_eos): long outputs (8 requests x
3,072 tokens) and many short ones (256 x 32 tokens, at most `--max-num-seqs` in flight on every
side). Every side runs the engine options `loraplex serve` builds from the same settings
(`vtc` scheduling, 8 LoRA slots and the server's other defaults, `_engine_options`). In one
run, per case:

- offline: the `LLM` API, every request in one `generate` (the reference);
- engine process: `EngineProcess.generate` in this process, no HTTP (adds the engine core's
  loop, delta encoding, the pipe, the reader thread's decoding);
- served: `loraplex serve` as a subprocess, /v1/completions streamed and not, tracing off and
  on (OTLP/HTTP to a local receiver that keeps only counts), the token count being the
  server's own usage figure. Beside tokens/s, the CPU seconds per 1k tokens of the server
  process and of its engine child (from /proc: steadier than rates on a shared machine).

The split: one instrumented offline run times, per generated token, the forward (the model
runner's `run`: forward + sampling), the engine's bookkeeping (the rest of `LLMEngine.step`),
and then, on each step's real outputs, what the engine process and the server do with them:
delta encoding (`OutputEncoder` + JSON), the pipe (send + receive of those bytes), decoding
(JSON + `OutputDecoder`), and an SSE chunk per token (`event` of a completion chunk).

    python -m benchmarks.serving_overhead                       # 8 x 3,072 and 256 x 32
    python -m benchmarks.serving_overhead --quick               # 8 x 384 and 64 x 32
    python -m benchmarks.serving_overhead --quick --md docs/serving-overhead.md \\
        --png docs/serving-overhead.png

From the checkout's root (the tiny model comes from testkit/factories).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
FULL = {"long": (8, 3072), "short": (256, 32)}
QUICK = {"long": (8, 384), "short": (64, 32)}
SIDES = ("offline", "engine process", "served stream", "served whole", "served stream traced")
STAGES = ("forward", "bookkeeping", "delta encoding", "pipe", "decoding", "SSE chunk")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="8 x 384 and 64 x 32 tokens")
    ap.add_argument("--long", type=str, default=None, help="N,TOKENS of the long case (0,0: none)")
    ap.add_argument("--short", type=str, default=None, help="N,TOKENS of the short case")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="requests at once, every side")
    ap.add_argument(
        "--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
        help="torch threads of the engine, every side (as `loraplex serve`: all cores but one)",
    )  # fmt: skip
    ap.add_argument("--no-traced", action="store_true", help="skip the traced server")
    ap.add_argument("--no-served", action="store_true", help="skip both servers")
    ap.add_argument(
        "--served-only",
        action="store_true",
        help="only the served sides (to compare two checkouts' servers, A B A B)",
    )
    ap.add_argument("--ledger", action="store_true",
                    help="only the usage ledger: entries from 32 threads, one transaction "
                         "each against grouped (platform/ledger.py)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    ap.add_argument("--md", type=Path, default=None, help="the table as markdown")
    ap.add_argument("--png", type=Path, default=None, help="the plot")


def _cases(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    cases = dict(QUICK if args.quick else FULL)
    for name in ("long", "short"):
        given = getattr(args, name)
        if given:
            n, tokens = (int(x) for x in given.split(","))
            cases[name] = (n, tokens)
    return {name: case for name, case in cases.items() if case[0] > 0}  # "0,0": case left out


def _context(tokens: int) -> int:
    return -(-(len(PROMPT) + tokens) // 64) * 64


def _params(tokens: int):
    from loraplex.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


# ------------------------------------------------------------------ offline and its split


def _settings(context: int, args) -> dict:
    """The engine's LORAPLEX_* settings, every side: the served side gets them as its
    environment, the offline and engine-process sides the `EngineConfig` the server builds from
    them (`_engine_options`), so every side runs the same engine options."""
    return {"dtype": "float32", "engine_threads": args.threads,
            "max_num_seqs": args.max_num_seqs, "max_model_len": context}  # fmt: skip


def _engine_options(model: str, context: int, args) -> dict:
    """The engine options `loraplex serve` runs with these settings (platform/main.py
    `engine_config`: the server's defaults, such as `vtc` scheduling and 8 LoRA slots, where
    `EngineConfig`'s own are first-come and 4), as keyword arguments."""
    from loraplex.engine import server_options
    from loraplex.platform.main import engine_config
    from loraplex.platform.settings import Settings

    config = engine_config(Settings(**_settings(context, args)), model)
    return {o.name: getattr(config, o.name) for o in server_options()}


def _llm(model: str, context: int, args):
    from loraplex.engine import LLM

    llm = LLM(model, **_engine_options(model, context, args))
    llm.generate([PROMPT], _params(4))
    return llm


def _offline(llm, n: int, tokens: int) -> dict:
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([PROMPT] * n, _params(tokens))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return {"tok_s": n * tokens / seconds, "engine_cpu_per_1k": 1e3 * cpu / (n * tokens)}


def _sse_chunk(out) -> str:
    from loraplex.platform.openai.responses import CompletionChunk, CompletionStreamChoice
    from loraplex.platform.openai.streaming import event

    choice = CompletionStreamChoice(index=0, text=out.delta_text, logprobs=None,
                                    finish_reason=out.outputs[0].finish_reason)  # fmt: skip
    chunk = CompletionChunk(id="cmpl-x", object="text_completion", created=0, model="m",
                            choices=[choice])  # fmt: skip
    return event(chunk)


def _split(llm, n: int, tokens: int) -> dict[str, float]:
    """Microseconds per generated token of each stage, on one instrumented offline run."""
    from loraplex.engine.process.output_deltas import OutputDecoder, OutputEncoder, StepMessage

    engine = llm.engine
    spent = dict.fromkeys(STAGES, 0.0)
    run, step = engine.runner.run, engine.step
    encoder, decoder = OutputEncoder(), OutputDecoder()
    recv, send = mp.Pipe(duplex=False)

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            spent["forward"] += time.perf_counter() - t0

    def timed_step():
        t0 = time.perf_counter()
        outs = step()
        spent["bookkeeping"] += time.perf_counter() - t0  # the forward is taken out below
        t = time.perf_counter()
        raw = StepMessage(outputs=[encoder.encode(o) for o in outs]).to_json()
        t1 = time.perf_counter()
        spent["delta encoding"] += t1 - t
        send.send_bytes(raw)
        got = recv.recv_bytes()
        t2 = time.perf_counter()
        spent["pipe"] += t2 - t1
        decoded = [decoder.decode(d) for d in StepMessage.from_json(got).outputs]
        t3 = time.perf_counter()
        spent["decoding"] += t3 - t2
        for out in decoded:
            _sse_chunk(out)
        spent["SSE chunk"] += time.perf_counter() - t3
        return outs

    engine.runner.run, engine.step = timed_run, timed_step
    try:
        llm.generate([PROMPT], _params(2))  # imports and first calls out of the figures
        spent.update(dict.fromkeys(STAGES, 0.0))
        outs = llm.generate([PROMPT] * n, _params(tokens))
    finally:
        engine.runner.run, engine.step = run, step
        recv.close()
        send.close()
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    spent["bookkeeping"] -= spent["forward"]
    return {k: 1e6 * v / (n * tokens) for k, v in spent.items()}


# ------------------------------------------------------------------ the engine process


def _engine_process(model: str, context: int, args):
    from loraplex.engine import EngineConfig
    from loraplex.engine.process.engine_process import EngineProcess

    config = EngineConfig(model, **_engine_options(model, context, args))
    return EngineProcess(config)


def _through(engine, n: int, tokens: int, args) -> dict:
    gate = asyncio.Semaphore(args.max_num_seqs)

    async def one(max_tokens: int) -> int:
        async with gate:
            last = None
            async for out in engine.generate(PROMPT, _params(max_tokens)):
                last = out
            return len(last.outputs[0].token_ids)

    async def all_of(count: int, max_tokens: int) -> list[int]:
        return await asyncio.gather(*(one(max_tokens) for _ in range(count)))

    asyncio.run(all_of(1, 4))
    t0 = time.perf_counter()
    counts = asyncio.run(all_of(n, tokens))
    seconds = time.perf_counter() - t0
    assert counts == [tokens] * n, counts
    return {"tok_s": n * tokens / seconds}


# ------------------------------------------------------------------ served


def _cpu(pid: int) -> float:
    from benchmarks.tracing_cost import cpu_seconds

    return cpu_seconds(pid)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                kids.append(int(entry.name))
    return kids


async def _client(srv, n: int, tokens: int, stream: bool, in_flight: int) -> int:
    import httpx

    gate = asyncio.Semaphore(in_flight)
    body = {"model": srv.model_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    limits = httpx.Limits(max_connections=in_flight + 4)

    async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=600,
                                 limits=limits) as http:  # fmt: skip

        async def one() -> int:
            async with gate:
                if not stream:
                    r = await http.post("/v1/completions", json=body)
                    r.raise_for_status()
                    return r.json()["usage"]["completion_tokens"]
                used = 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage": {' in line:
                            used = json.loads(line[6:])["usage"]["completion_tokens"]
                return used

        return sum(await asyncio.gather(*(one() for _ in range(n))))


def _served(srv, n: int, tokens: int, stream: bool, args) -> dict:
    asyncio.run(_client(srv, 2, 4, stream, 2))
    kids = _children(srv.proc.pid)
    cpu0 = _cpu(srv.proc.pid), sum(_cpu(k) for k in kids)
    t0 = time.perf_counter()
    used = asyncio.run(_client(srv, n, tokens, stream, args.max_num_seqs))
    seconds = time.perf_counter() - t0
    cpu1 = _cpu(srv.proc.pid), sum(_cpu(k) for k in kids)
    assert used == n * tokens, (used, n * tokens)  # the ledger's count: every token billed
    per_1k = 1e3 / used
    return {"tok_s": used / seconds, "server_cpu_per_1k": (cpu1[0] - cpu0[0]) * per_1k,
            "engine_cpu_per_1k": (cpu1[1] - cpu0[1]) * per_1k}  # fmt: skip


def _server_runs(model: str, cases: dict, args, traced: bool, data: Path) -> dict:
    from benchmarks.server import LoraplexServer
    from benchmarks.tracing_cost import _Receiver

    extra, receiver = {}, None
    if traced:
        receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
        receiver.exports = receiver.bytes = 0
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        extra["otlp_traces_endpoint"] = f"http://127.0.0.1:{receiver.server_port}"
    longest = max(t for _, t in cases.values())
    name = "traced" if traced else "plain"
    results: dict = {}
    try:
        with LoraplexServer(model, data / name, log=data / f"{name}.log",
                            **_settings(_context(longest), args), **extra) as srv:  # fmt: skip
            for case, (n, tokens) in cases.items():
                if traced:
                    results[case] = {"served stream traced": _served(srv, n, tokens, True, args)}
                else:
                    results[case] = {
                        "served stream": _served(srv, n, tokens, True, args),
                        "served whole": _served(srv, n, tokens, False, args),
                    }
    finally:
        if receiver is not None:
            receiver.shutdown()
    return results


# ------------------------------------------------------------------ the run and its table


def _engine_sides(doc: dict, model: str, cases: dict, args) -> None:
    """Offline, its split, and the engine process without HTTP, per case."""
    longest = max(t for _, t in cases.values())
    llm = _llm(model, _context(longest), args)
    for case, (n, tokens) in cases.items():
        doc["cases"][case]["sides"]["offline"] = _offline(llm, n, tokens)
        doc["cases"][case]["split_us_per_token"] = _split(llm, n, tokens)
    del llm
    engine = _engine_process(model, _context(longest), args)
    try:
        for case, (n, tokens) in cases.items():
            doc["cases"][case]["sides"]["engine process"] = _through(engine, n, tokens, args)
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> dict:
    from benchmarks.assets import factories
    from loraplex.bench.sysinfo import machine

    cases = _cases(args)
    doc: dict = {"bench": "serving-overhead", "machine": machine(), "cases": {},
                 "command": "python -m benchmarks.serving_overhead " + " ".join(sys.argv[1:]),
                 "max_num_seqs": args.max_num_seqs, "threads": args.threads,
                 "loadavg_before": os.getloadavg()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(t for _, t in cases.values())
        model = str(factories().make_tiny_model("llama", Path(tmp) / "llama",
                                                max_position_embeddings=longest + 64))  # fmt: skip
        for case, (n, tokens) in cases.items():
            doc["cases"][case] = {"requests": n, "tokens": tokens, "sides": {}}
        doc["engine_options"] = _engine_options(model, _context(longest), args)
        if not args.served_only:
            _engine_sides(doc, model, cases, args)
        for traced in () if args.no_served else (False,) if args.no_traced else (False, True):
            for case, sides in _server_runs(model, cases, args, traced, Path(tmp)).items():
                doc["cases"][case]["sides"].update(sides)
    doc["loadavg_after"] = os.getloadavg()
    for c in doc["cases"].values():
        offline = c["sides"].get("offline", {}).get("tok_s")
        for side in c["sides"].values():
            side["over_offline"] = side["tok_s"] / offline if offline else float("nan")
    table = markdown(doc)
    print(table)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    if args.png:
        plot(doc, args.png)
    return doc


def markdown(doc: dict) -> str:
    lines = [
        "| case | side | tok/s | / offline | server CPU ms / 1k tok | engine CPU ms / 1k tok |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in doc["cases"].items():
        label = f"{name}: {c['requests']} x {c['tokens']:,}"
        for side in SIDES:
            s = c["sides"].get(side)
            if s is None:
                continue
            server = s.get("server_cpu_per_1k")
            engine = s.get("engine_cpu_per_1k")
            lines.append(
                f"| {label} | {side} | {s['tok_s']:,.1f} | {_ratio(s['over_offline'])} "
                f"| {'' if server is None else f'{1e3 * server:,.1f}'} "
                f"| {'' if engine is None else f'{1e3 * engine:,.1f}'} |"
            )
    if any("split_us_per_token" in c for c in doc["cases"].values()):
        lines += ["", "| case | " + " | ".join(f"{s} µs/tok" for s in STAGES) + " |",
                  "| --- |" + " --- |" * len(STAGES)]  # fmt: skip
    for name, c in doc["cases"].items():
        split = c.get("split_us_per_token")
        if split is None:
            continue
        lines.append(f"| {name} | " + " | ".join(f"{split[s]:,.1f}" for s in STAGES) + " |")
    if "loadavg_before" in doc and "loadavg_after" in doc:  # how loaded the machine was
        before, after = doc["loadavg_before"][0], doc["loadavg_after"][0]
        lines += ["", f"Load average (1 min) {before:.1f} at the start, {after:.1f} at the end."]
    return "\n".join(lines) + "\n"


def _ratio(x: float) -> str:
    return "" if x != x else f"{x:.2f}"  # NaN: no offline side (--served-only)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(doc["cases"])
    width = 0.8 / len(SIDES)
    for i, side in enumerate(SIDES):
        vals = [doc["cases"][c]["sides"].get(side, {}).get("over_offline", 0) for c in names]
        left.bar([j + i * width for j in range(len(names))], vals, width, label=side)
    left.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    left.set_ylabel("tokens/s over offline")
    left.legend(fontsize=7)
    names = [c for c in names if "split_us_per_token" in doc["cases"][c]]
    bottom = [0.0] * len(names)
    for stage in STAGES:
        vals = [doc["cases"][c]["split_us_per_token"][stage] for c in names]
        right.bar(names, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    right.set_ylabel("µs per generated token")
    right.legend(fontsize=7)
    fig.suptitle(f"serving overhead, tiny random llama ({doc['machine'].get('cpu', '')})",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ledger(entries: int = 512, threads: int = 32) -> str:
    """The usage ledger on SQLite: `entries` request ends from `threads` threads at once, each
    written in a transaction of its own (`_write_one`, the path before group commit) and
    through `write` (grouped), alternated twice; CPU and wall microseconds per entry."""
    rows = ["| writes | CPU µs / entry | wall µs / entry |", "| --- | --- | --- |"]
    for how in ("one transaction each", "grouped", "one transaction each", "grouped"):
        with tempfile.TemporaryDirectory() as tmp:
            cpu, wall = _ledger_arm(Path(tmp), how == "grouped", entries, threads)
        rows.append(f"| {how} | {1e6 * cpu / entries:,.0f} | {1e6 * wall / entries:,.0f} |")
    return "\n".join(rows) + "\n"


def _ledger_arm(tmp: Path, grouped: bool, entries: int, threads: int) -> tuple[float, float]:
    from datetime import UTC, datetime

    from loraplex.platform import ledger as book
    from loraplex.platform.db import crud
    from loraplex.platform.db.health import DatabaseHealth
    from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
    from loraplex.platform.journal import Journal

    url = f"sqlite:///{tmp}/registry.db"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    with sessions() as s:
        tenant = crud.create_tenant(s, name="acme").id
        crud.set_quota(s, tenant_id=tenant, tokens_per_min=10**9)
    led = book.Ledger(sessions, Journal(tmp / "journal.db"), DatabaseHealth())
    write = led.write if grouped else led._write_one
    now = datetime.now(UTC)
    todo, lock = iter(range(entries)), threading.Lock()

    def ends() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            record = dict(request_id=f"cmpl-{i}", tenant_id=tenant, model="m", status="ok",
                          prompt_tokens=8, completion_tokens=32, latency_ms=1.0,
                          created_at=now)  # fmt: skip
            write(book.usage_entry(record, tenant_id=tenant, adjust=-3, charged_at=now))

    cpu0, t0 = time.process_time(), time.perf_counter()
    workers = [threading.Thread(target=ends) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    led.close()
    db.dispose()
    return cpu, wall


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser

    args = parser(__doc__, add_args).parse_args(argv)
    if args.ledger:
        print(ledger())
        return
    run(args)


if __name__ == "__main__":
    main()
