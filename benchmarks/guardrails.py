"""What a guard adapter costs: throughput and TTFT with no guard, with a guard adapter on input
and output scored in the engine's own batches, and with the same classifier behind an external
moderation call over HTTP, side by side in one run.

    python -m benchmarks.guardrails [--requests 48] [--concurrency 8] [--max-tokens 32]
                                    [--rounds 3] [--train]

Two `loraplex serve` processes on this machine's CPU, on the tiny random Llama: the server
under test, and a stand-in moderation service (a second server on the same base holding the
same guard adapter, as a gateway's moderation endpoint would hold its own copy of a model).
The policy's action is `flag`, so every scenario generates the same tokens and only the
checks differ; the guard's verdicts change no work, so by default it is an untrained adapter of
a trained guard's shape (rank 8 on every projection; `--train` trains one as
testkit/guard_training.py does, minutes on a loaded CPU, the same cost per call):

- `none`: the tenant has no policy;
- `guard adapter`: the tenant's policy runs the guard on the prompt and on each output window
  (every 16 characters of a stream, platform/guardrails/stream.py);
- `external HTTP`: no policy; the client calls the moderation service on the prompt before
  the request and on the whole answer after it (what a gateway's pre- and post-call hooks do;
  it judges the output once, not as it streams).

Each round runs the three in a rotating order on the same prompts. Streams of `--max-tokens`
tokens, `--concurrency` at a time; TTFT is the client's, from sending (the moderation call
included) to the first text; tokens/s is all answers' completion tokens over the scenario's
wall time. Prints a table and writes docs/guardrails-bench.json and docs/guardrails-bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.assets import factories, import_installed_kernels, tiny_llama
from benchmarks.server import ADMIN_KEY, LoraplexServer

DOCS = Path(__file__).resolve().parent.parent / "docs"
SCENARIOS = ("none", "guard adapter", "external HTTP")


def prompts(n: int, seed: int = 0) -> list[str]:
    from testkit.guard_training import sample_text

    rng = random.Random(seed)
    return [sample_text(rng, unsafe=False) for _ in range(n)]


def guarded_tenant(srv: LoraplexServer) -> str:
    """A second tenant with a guard policy (its own copy of the guard) and its key."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    t = httpx.post(f"{srv.url}/admin/api/tenants", headers=admin,
                   json={"name": f"guarded-{os.getpid()}"}, timeout=30).json()  # fmt: skip
    k = httpx.post(f"{srv.url}/admin/api/tenants/{t['id']}/keys", headers=admin, json={},
                   timeout=30).json()  # fmt: skip
    key = k["secret"]
    policy = {"name": "guard", "stages": "both", "action": "flag", "fail_mode": "open",
              "guard_adapter": "guard"}  # fmt: skip
    r = httpx.post(f"{srv.url}/admin/api/tenants/{t['id']}/guardrails", headers=admin,
                   json=policy, timeout=30)  # fmt: skip
    r.raise_for_status()
    return key


class Moderation:
    """The stand-in moderation endpoint: the guard's verdict over HTTP (one greedy token)."""

    def __init__(self, srv: LoraplexServer, tok) -> None:
        from loraplex.platform.guardrails.guard import BIAS, verdict_tokens

        self.srv, self.tok = srv, tok
        safe, unsafe = verdict_tokens(tok)
        self.bias = {str(safe): BIAS, str(unsafe): BIAS}

    async def check(self, client: httpx.AsyncClient, text: str) -> None:
        from loraplex.platform.guardrails.guard import guard_prompt_ids

        ids = guard_prompt_ids(self.tok, text, 200)
        body = {"model": "guard", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "logit_bias": self.bias, "logprobs": 1}  # fmt: skip
        r = await client.post(f"{self.srv.url}/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {self.srv.api_key}"})  # fmt: skip
        r.raise_for_status()


async def one(client, url, key, model, prompt, max_tokens, moderation) -> tuple[float, int]:
    """(TTFT s, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    if moderation is not None:
        await moderation.check(client, prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    ttft, tokens, text = None, 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(c.get("text") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if moderation is not None:
        await moderation.check(client, "".join(text))
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def scenario(url, key, model, texts, args, moderation) -> dict:
    sem = asyncio.Semaphore(args.concurrency)

    async def run(p):
        async with sem:
            return await one(client, url, key, model, p, args.max_tokens, moderation)

    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in texts))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    return {"tokens_per_s": sum(n for _, n in results) / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))]}  # fmt: skip


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = list(summary)
    a.bar(names, [summary[n]["tokens_per_s"] for n in names], color=["#888", "#2a7", "#c63"])
    a.set_ylabel("output tokens/s")
    b.bar(names, [summary[n]["ttft_p50_ms"] for n in names], color=["#888", "#2a7", "#c63"])
    b.set_ylabel("TTFT p50 (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("guard adapter in the engine's batches vs an external moderation call (CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train", action="store_true", help="train the guard (same cost per call)")
    args = ap.parse_args()
    load_start = os.getloadavg()
    import_installed_kernels()  # before peft / transformers, from a checkout's root
    from loraplex.engine import Tokenizer
    from testkit.guard_training import train_guard

    base = tiny_llama()
    tok = Tokenizer.from_dir(base)
    with tempfile.TemporaryDirectory() as tmp:
        if args.train:
            guard = train_guard(base, Path(tmp) / "guard")
        else:
            targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            guard = factories().make_adapter(base, Path(tmp) / "guard", r=8, targets=targets)
        common = {"dtype": "float32", "max_model_len": 512}
        with LoraplexServer(base, Path(tmp) / "srv", **common) as srv, \
             LoraplexServer(base, Path(tmp) / "mod", **common) as mod:  # fmt: skip
            srv.upload("guard", guard)
            mod.upload("guard", guard)
            guarded_key = guarded_tenant(srv)
            moderation = Moderation(mod, tok)
            runs: dict[str, list[dict]] = {s: [] for s in SCENARIOS}
            for rnd in range(args.rounds):
                texts = prompts(args.requests, seed=rnd)
                order = SCENARIOS[rnd % 3 :] + SCENARIOS[: rnd % 3]
                for name in order:
                    key = guarded_key if name == "guard adapter" else srv.api_key
                    mod_ = moderation if name == "external HTTP" else None
                    r = asyncio.run(scenario(srv.url, key, srv.model_name, texts, args, mod_))
                    runs[name].append(r)
                    print(f"round {rnd} {name:14s} {r['tokens_per_s']:7.1f} tok/s  "
                          f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms", flush=True)  # fmt: skip
    summary = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    none = summary["none"]["tokens_per_s"]
    print("\n| scenario | output tokens/s | vs none | TTFT p50 ms | TTFT p90 ms |")
    print("| --- | --- | --- | --- | --- |")
    for n, s in summary.items():
        print(f"| {n} | {s['tokens_per_s']:.1f} | {100 * (s['tokens_per_s'] / none - 1):+.1f} % "
              f"| {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} |")  # fmt: skip
    # Each round's throughput over the same round's `none`: the load swings between rounds
    # more than between the scenarios of one round, so the median of these ratios is the
    # steadier figure of the cost.
    ratios = {
        n: [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, runs["none"], strict=True)]
        for n, rs in runs.items()
    }
    for n, rs in ratios.items():
        print(f"{n:14s} per-round tok/s vs none: median {statistics.median(rs):.3f}, "
              f"range {min(rs):.3f} to {max(rs):.3f}")  # fmt: skip
    doc = {"args": vars(args), "cpus": os.cpu_count(), "load_start": load_start,
           "load": os.getloadavg(), "summary": summary,
           "round_ratios": {n: {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}
                            for n, rs in ratios.items()},
           "runs": runs}  # fmt: skip
    (DOCS / "guardrails-bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(summary, DOCS / "guardrails-bench.png")


if __name__ == "__main__":
    main()
