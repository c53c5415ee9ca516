"""`python -m benchmarks.disagg`: decode streams while long prompts arrive in bursts, on
prefill and decode workers (engine/disagg) against colocated engines, cores split equally.

Both arms run in one invocation, one after the other, on the same schedule:

- colocated: two engine processes, one torch thread each; requests alternate between them
  (each engine prefills its share of the bursts between its streams' decode steps, chunked
  as the engine chunks prompts);
- disaggregated: a prefill worker and a decode worker, one process and one torch thread each,
  sharing a disk KV tier (a temporary folder); handoffs go from one to the other over a pipe.

The schedule: `--streams` requests with short prompts and `--stream-tokens` output tokens
start at once; from `--first-burst` seconds on, every `--burst-every` seconds, a burst of
`--burst-prompts` requests with `--burst-len`-token prompts and `--burst-tokens` outputs
arrives. Requests cycle over the base model and `--adapters` adapters; greedy, EOS ignored.

Timed where the tokens come out (time.time() in each worker; one host, one clock): a
stream's inter-token latency (ITL) is the gap between its successive outputs, "during
bursts" the gaps that end between a burst's arrival and its last request's first token;
TTFT from arrival to the first output (disaggregated: the decode worker's first output,
where the client's stream begins); throughput, output tokens over the run. KV moved: the
bytes the prefill worker wrote to the tier and the decode worker read from it, per prompt
token handed over. Greedy outputs of the two arms are compared.

    python -m benchmarks.disagg --model demo --dtype float32
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import zlib
from pathlib import Path

STREAM_PROMPT = 32


def _schedule(args, adapters: list[str]) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(10, 20000, (n,), generator=g).tolist()

    loras = [None, *adapters]
    reqs = []
    for i in range(args.streams):
        reqs.append(dict(rid=f"s{i}", kind="stream", at=0.0, prompt=prompt(STREAM_PROMPT),
                         max_tokens=args.stream_tokens))  # fmt: skip
    for b in range(args.bursts):
        for j in range(args.burst_prompts):
            at = args.first_burst + b * args.burst_every
            reqs.append(dict(rid=f"b{b}-{j}", kind="burst", burst=b, at=at,
                             prompt=prompt(args.burst_len),
                             max_tokens=args.burst_tokens))  # fmt: skip
    for i, r in enumerate(reqs):
        r["lora"] = loras[i % len(loras)]
    return reqs


def _engine(model: str, args, tier: str | None):
    import torch

    from loraplex.engine import LLMEngine
    from loraplex.engine.config import EngineConfig

    torch.set_num_threads(1)
    tiers = dict(kv_tier_disk_path=tier) if tier else {}
    return LLMEngine(EngineConfig(model=model, dtype=args.dtype, block_size=16,
                                  max_model_len=args.burst_len + 512, max_loras=2,
                                  max_lora_rank=8, num_threads=1,
                                  kv_cache_bytes=args.kv_cache_mib << 20, **tiers))  # fmt: skip


def _lora(path):
    from loraplex.engine import LoRARequest

    if path is None:
        return None
    return LoRARequest(Path(path).name, zlib.crc32(path.encode()) % 10**6 + 1, path)


def _params(r):
    from loraplex.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)


def _record(times: dict, out) -> None:
    n = sum(len(c.token_ids) for c in out.outputs)
    seen = times.setdefault(out.request_id, [])
    if n > (seen[-1][1] if seen else 0):
        seen.append((time.time(), n))


def _run(role: str, model: str, args, reqs, tier, ready, start, inbox, outbox, results):
    """One worker process: role "both" (a colocated engine), "prefill" or "decode"."""
    from loraplex.engine.disagg import DecodeWorker, Handoff, PrefillWorker

    engine = _engine(model, args, tier)
    worker = {"prefill": PrefillWorker, "decode": DecodeWorker}.get(role, lambda e: e)(engine)
    # Load the adapters before the clock starts (both arms alike).
    for r in reqs[:3]:
        if r["lora"] is not None:
            engine.adapters.acquire(_lora(r["lora"]))
            engine.adapters.wait(_lora(r["lora"]).lora_int_id)
            engine.adapters.poll()
            engine.adapters.release(_lora(r["lora"]))
    ready.put(role)
    t0 = start.get()
    pending = sorted(reqs, key=lambda r: r["at"])
    times: dict = {}
    texts: dict = {}
    upstream_done = role != "decode"
    while True:
        now = time.time()
        while pending and t0 + pending[0]["at"] <= now:
            r = pending.pop(0)
            add = worker.add_request if role == "prefill" else engine.add_request
            add(r["rid"], r["prompt"], _params(r), _lora(r["lora"]))
        if role == "decode":
            try:
                while True:
                    item = inbox.get(timeout=0 if worker.has_unfinished() else 0.002)
                    if item is None:
                        upstream_done = True
                        break
                    first = worker.add_handoff(Handoff.from_json(item))
                    if first is not None:
                        _record(times, first)
            except queue.Empty:
                pass
        busy = worker.has_unfinished()
        if not busy:
            if not pending and upstream_done:
                break
            if role != "decode":
                time.sleep(0.002)
            continue
        for out in worker.step():
            if role == "prefill" and isinstance(out, Handoff):
                outbox.put(out.to_json())
                continue
            _record(times, out)
            if out.finished:
                texts[out.request_id] = out.outputs[0].token_ids
    if role == "prefill":
        outbox.put(None)  # the decode worker ends once it has finished what it was handed
    tiers = engine.kv_tiers
    counters = {n: vars(c) for n, c in tiers.counters.items()} if tiers else {}
    results.put(dict(role=role, times=times, tokens=texts, counters=counters,
                     loaded=tiers.tokens_loaded if tiers else 0,
                     prompt_computed=engine.num_prompt_tokens_computed))  # fmt: skip
    engine.close()


def _arm(name: str, model: str, args, reqs) -> dict:
    ctx = mp.get_context("spawn")
    ready, results, pipe = ctx.Queue(), ctx.Queue(), ctx.Queue()
    starts = []
    procs = []
    with tempfile.TemporaryDirectory() as tier:
        if name == "colocated":
            plan = [("both", reqs[i::2], None, None, None) for i in range(2)]
        else:
            plan = [("prefill", reqs, tier, None, pipe), ("decode", [], tier, pipe, None)]
        for role, share, t, inbox, outbox in plan:
            start = ctx.Queue()
            starts.append(start)
            p = ctx.Process(target=_run, args=(role, model, args, share, t, ready, start, inbox,
                                               outbox, results))  # fmt: skip
            p.start()
            procs.append(p)
        for _ in procs:
            ready.get(timeout=600)
        t0 = time.time() + 0.5
        for s in starts:
            s.put(t0)
        got = [results.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(60)
    times, tokens = {}, {}
    for g in got:
        times.update(g["times"])
        tokens.update(g["tokens"])
    return dict(t0=t0, times=times, tokens=tokens, workers=got)


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)  # nearest rank
    return v[max(0, math.ceil(q * len(v)) - 1)]


def summarize(arm: dict, reqs: list[dict], block: int = 16) -> dict:
    t0, times = arm["t0"], arm["times"]
    by = {r["rid"]: r for r in reqs}
    windows = []
    for b in sorted({r["burst"] for r in reqs if r["kind"] == "burst"}):
        burst = [r for r in reqs if r.get("burst") == b]
        firsts = [times[r["rid"]][0][0] for r in burst if times.get(r["rid"])]
        windows.append((t0 + burst[0]["at"], max(firsts) if firsts else t0 + burst[0]["at"]))
    itl, itl_burst, ttft = [], [], {"stream": [], "burst": []}
    for rid, ts in times.items():
        r = by[rid]
        ttft[r["kind"]].append(ts[0][0] - (t0 + r["at"]))
        if r["kind"] != "stream":
            continue
        for (a, _), (b, _) in zip(ts, ts[1:], strict=False):
            itl.append(b - a)
            if any(lo <= b <= hi for lo, hi in windows):
                itl_burst.append(b - a)
    end = max(ts[-1][0] for ts in times.values())
    out_tokens = sum(ts[-1][1] for ts in times.values())
    kv = {}
    for w in arm["workers"]:
        disk = w["counters"].get("disk")
        if disk:
            kv[w["role"]] = (disk["bytes_written"], disk["bytes_read"])
    handed = sum(len(r["prompt"]) // block * block for r in reqs)
    moved = sum(b for _, b in kv.values())
    return {
        "itl_p50_ms": 1000 * _p(itl, 0.5),
        "itl_p99_ms": 1000 * _p(itl, 0.99),
        "itl_p99_burst_ms": 1000 * _p(itl_burst, 0.99),
        "burst_gaps": len(itl_burst),
        "ttft_stream_p50_s": statistics.median(ttft["stream"]),
        "ttft_burst_p50_s": statistics.median(ttft["burst"]) if ttft["burst"] else float("nan"),
        "throughput_tok_s": out_tokens / (end - t0),
        "kv_bytes_read": moved,
        "kv_bytes_per_token": moved / handed if moved else 0.0,
        "makespan_s": end - t0,
    }


def plot(arms: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, arm in arms.items():
        t0 = arm["t0"]
        xs, ys = [], []
        for rid, ts in arm["times"].items():
            if rid.startswith("s"):
                for (a, _), (b, _) in zip(ts, ts[1:], strict=False):
                    xs.append(b - t0)
                    ys.append(1000 * (b - a))
        ax[0].scatter(xs, ys, s=4, label=name)
        s = arm["summary"]
        ax[1].bar([f"{name}\nITL p99", f"{name}\nITL p99 burst"],
                  [s["itl_p99_ms"], s["itl_p99_burst_ms"]])  # fmt: skip
    ax[0].set_xlabel("seconds into the run")
    ax[0].set_ylabel("decode stream ITL (ms)")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[1].set_ylabel("ms")
    ax[1].tick_params(axis="x", labelsize=7)
    fig.suptitle("decode ITL while long prompts arrive: disaggregated vs colocated, 1 thread each")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="tiny-llama, demo or a model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--adapters", type=int, default=2)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--burst-prompts", type=int, default=2)
    p.add_argument("--burst-len", type=int, default=1024)
    p.add_argument("--burst-tokens", type=int, default=8)
    p.add_argument("--first-burst", type=float, default=2.0)
    p.add_argument("--burst-every", type=float, default=8.0)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--out", default="benchmarks/results/disagg.json")
    p.add_argument("--png", default="docs/disaggregation.png")
    args = p.parse_args(argv)

    from benchmarks.assets import prepare

    model, adapters = prepare(args.model, args.adapters)
    reqs = _schedule(args, [str(a) for a in adapters])
    load = os.getloadavg()
    arms = {}
    for name in ("colocated", "disaggregated"):
        arms[name] = _arm(name, str(model), args, reqs)
        arms[name]["summary"] = summarize(arms[name], reqs)
    same = arms["colocated"]["tokens"] == arms["disaggregated"]["tokens"]
    keys = list(arms["colocated"]["summary"])
    print(f"load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"greedy outputs equal in both arms: {same}")  # fmt: skip
    print(f"{'':24}" + "".join(f"{n:>16}" for n in arms))
    for k in keys:
        print(f"{k:24}" + "".join(f"{arms[n]['summary'][k]:>16.4g}" for n in arms))
    c, d = arms["colocated"]["summary"], arms["disaggregated"]["summary"]
    print(f"ITL p99 during bursts, disaggregated / colocated: "
          f"{d['itl_p99_burst_ms'] / c['itl_p99_burst_ms']:.3f}; throughput ratio "
          f"{d['throughput_tok_s'] / c['throughput_tok_s']:.3f}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "load_avg": load, "outputs_equal": same,
        "summary": {n: a["summary"] for n, a in arms.items()},
    }, indent=1))  # fmt: skip
    plot(arms, Path(args.png))
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
