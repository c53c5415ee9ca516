"""`python -m benchmarks.kv_tiers`: later turns of multi-turn chats on two replicas with
round-robin routing, with the shared KV tier (engine/memory/tiers) and without, and what the
two shared stores cost per block.

Two parts, both printed side by side and written to `--out` (JSON) and `--png`:

- store costs: `--blocks` records of the model's KV block size written to and read back from
  Redis (127.0.0.1:6379, SET / MGET, as the tier does) and from S3 (a local moto server over
  HTTP, PUT / GET per block), best of `--repeats`: the measured ground for the docs' choice.
- TTFT: `--conversations` chats per history length (`--histories`, tokens), `--turns` turns
  each, turn t on replica (conversation + t) mod 2. Conversation c belongs to tenant
  c mod `--tenants` (its requests carry the tenant and the tenant's cache salt, as the
  platform's do) and runs on adapter c mod (`--adapters` + 1) (0: the base model). Each
  turn sends the whole history (the previous turns' prompts and answers) plus
  `--new-tokens` new ones and asks for `--max-tokens`. Fleet "tiers": both replicas on one
  Redis tier; fleet "recompute": the same without tiers (each replica still has its own
  device prefix cache). Between turns the replicas' tier writes are let finish (a user reads
  an answer before sending the next turn).
  TTFT is timed in-process from add_request to the first token, on the engine's own thread.
  p50 and p99 (nearest rank: with few later turns, p99 is their maximum) per history length;
  the shared tier's hit rate (blocks found of blocks looked up) and the bytes it read per
  prompt token it spared.

    python -m benchmarks.kv_tiers --model demo --histories 2048,4096,8192
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import uuid
from pathlib import Path

import torch

from benchmarks.assets import prepare
from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.memory.tiers import keys as K
from loraplex.engine.memory.tiers.stores import RedisStore, S3Store

REDIS = "redis://127.0.0.1:6379/0"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def store_costs(block_bytes: int, blocks: int, repeats: int) -> dict:
    """Seconds to write and to read `blocks` records of `block_bytes` on Redis and on S3."""
    from testkit.moto_server import ACCESS_KEY, REGION, SECRET_KEY, moto_server

    payload = os.urandom(block_bytes)
    keys = [uuid.uuid4().bytes * 2 for _ in range(blocks)]
    records = [K.encode(k, payload) for k in keys]
    out = {}
    with moto_server() as endpoint:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                          AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION)  # fmt: skip
        s3 = S3Store("s3://kv-bench/run")
        s3.client.create_bucket(Bucket="kv-bench")
        redis = RedisStore(REDIS, ttl_s=600, prefix=f"lpkv-bench-{uuid.uuid4()}:")
        for name, store in (("redis", redis), ("s3", s3)):

            def put(store=store):
                for k, r in zip(keys, records, strict=True):
                    store.put(k, r)

            def get(store=store):
                got = store.get_many(keys)
                assert all(K.decode(k, r, block_bytes) for k, r in zip(keys, got, strict=True))

            out[name] = {"put_s": _best(put, repeats), "get_s": _best(get, repeats)}
    return out


def _ttft(llm: LLM, prompt: list[int], params: SamplingParams, lora=None,
          tenant=None) -> tuple[float, list[int]]:  # fmt: skip
    engine = llm.engine
    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params, lora, tenant=tenant)
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if out.finished:
                tokens = out.outputs[0].token_ids
    return first, tokens


def _fleet(model: Path, tiers: bool, base: dict, salt: str) -> list[LLM]:
    kw = dict(kv_tier_shared_url=REDIS, kv_tier_salt=salt) if tiers else {}
    return [LLM(str(model), **kw, **base) for _ in range(2)]


def chats(model: Path, adapters: list[Path], args) -> tuple[list[dict], int, int]:
    """The conversations on fleet "tiers", then on fleet "recompute" (one fleet resident at a
    time: two fleets of the demo model at once outgrow a small machine's memory)."""
    longest = max(args.histories) + args.turns * (args.new_tokens + args.max_tokens) + 64
    base = dict(dtype=args.dtype, max_model_len=longest, max_lora_rank=8,
                max_loras=max(1, len(adapters)),
                kv_cache_bytes=args.kv_cache_mib << 20)  # fmt: skip
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    tenant_salts = [uuid.uuid4().hex for _ in range(args.tenants)]
    salt = uuid.uuid4().hex  # this run's blocks only
    rows, answers, block = [], {}, None
    for fleet in ("tiers", "recompute"):
        replicas = _fleet(model, fleet == "tiers", base, salt)
        vocab = replicas[0].engine.vocab_size
        if fleet == "tiers":
            engine = replicas[0].engine
            block = engine.kv_tiers.layout.block_bytes, engine.config.block_size
        g = torch.Generator().manual_seed(0)  # the same conversations in both fleets
        for h in args.histories:
            for c in range(args.conversations):
                first = torch.randint(100, vocab, (h,), generator=g).tolist()
                news = [torch.randint(100, vocab, (args.new_tokens,), generator=g).tolist()
                        for _ in range(args.turns)]  # fmt: skip
                tenant, lora = c % args.tenants, loras[c % len(loras)]
                params = SamplingParams(
                    temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                    cache_salt=tenant_salts[tenant],
                )  # fmt: skip
                history = list(first)
                for t in range(args.turns):
                    llm = replicas[(c + t) % 2]
                    shared = llm.engine.kv_tiers.counters["shared"] if fleet == "tiers" else None
                    hits0, read0 = (shared.hits, shared.bytes_read) if shared else (0, 0)
                    asked0 = shared.queried if shared else 0
                    ttft, out = _ttft(llm, history, params, lora, tenant=f"t{tenant}")
                    for r in replicas:  # the user reads the answer: writes finish meanwhile
                        if r.engine.kv_tiers:
                            r.engine.kv_tiers.flush()
                    rows.append({
                        "history": h, "conversation": c, "turn": t, "fleet": fleet,
                        "tenant": tenant, "adapter": lora.lora_name if lora else None,
                        "prompt_tokens": len(history), "ttft_s": ttft,
                        "shared_queried_blocks": shared.queried - asked0 if shared else 0,
                        "shared_hit_blocks": shared.hits - hits0 if shared else 0,
                        "shared_bytes": shared.bytes_read - read0 if shared else 0,
                    })  # fmt: skip
                    answers.setdefault((h, c, t), []).append(out)
                    print(f"{fleet:>9}  history {h:>5}  conv {c}  turn {t}: "
                          f"{len(history):>5} tokens, TTFT {ttft:7.3f} s", flush=True)  # fmt: skip
                    history = history + out + news[t]
        for r in replicas:
            r.engine.close()
            r.engine.adapters.close()
        del replicas, llm
        gc.collect()
    for r in rows:
        if r["fleet"] == "recompute" and r["turn"] == args.turns - 1:
            key = r["history"], r["conversation"]
            r["greedy_equal"] = all(a[0] == a[1] for (h, c, _), a in answers.items()
                                    if (h, c) == key)  # fmt: skip
    return rows, *block


def _p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (of fewer than 100 values: the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(rows: list[dict], block_size: int) -> list[dict]:
    table = []
    for h in sorted({r["history"] for r in rows}):
        later = {f: [r for r in rows if r["history"] == h and r["turn"] > 0 and r["fleet"] == f]
                 for f in ("tiers", "recompute")}  # fmt: skip
        t = [r["ttft_s"] for r in later["tiers"]]
        rc = [r["ttft_s"] for r in later["recompute"]]
        hits = sum(r["shared_hit_blocks"] for r in later["tiers"])
        asked = sum(r["shared_queried_blocks"] for r in later["tiers"])
        table.append({
            "history": h, "later_turns": len(t),
            "tiers_p50_s": statistics.median(t), "tiers_p99_s": _p99(t),
            "recompute_p50_s": statistics.median(rc), "recompute_p99_s": _p99(rc),
            "ratio_p50": statistics.median(t) / statistics.median(rc),
            "shared_hit_rate": hits / asked if asked else None,
            "shared_hit_tokens": hits * block_size,
            "bytes_per_token_saved": (sum(r["shared_bytes"] for r in later["tiers"])
                                      / max(1, hits * block_size)),
        })  # fmt: skip
    return table


def plot(rows: list[dict], png: Path) -> None:
    """TTFT of each later turn, both fleets side by side (p50 over conversations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["history"], r["turn"]) for r in rows if r["turn"] > 0})

    def p50(fleet, h, t):
        case = (fleet, h, t)
        return statistics.median(
            r["ttft_s"] for r in rows if (r["fleet"], r["history"], r["turn"]) == case
        )

    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [p50("recompute", h, t) for h, t in cases], 0.4,
           label="recompute (no tiers)")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [p50("tiers", h, t) for h, t in cases], 0.4,
           label="shared Redis tier")  # fmt: skip
    names = [f"{h} tokens\nturn {t} ({'other' if t % 2 else 'first'} replica)" for h, t in cases]
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Later turns of a chat, round-robin over two replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="tiny-llama, demo or a model folder")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--histories", default="2048,4096,8192")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tenants", type=int, default=2, help="conversation c is tenant c mod this")
    p.add_argument("--adapters", type=int, default=1, help="besides the base model")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--blocks", type=int, default=64, help="records per store-cost run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/kv-tiers.json")
    p.add_argument("--png", default="docs/kv-tiers.png")
    args = p.parse_args(argv)
    args.histories = [int(x) for x in args.histories.split(",")]
    model, adapters = prepare(args.model, args.adapters)
    rows, block_bytes, block_size = chats(model, adapters, args)
    costs = store_costs(block_bytes, args.blocks, args.repeats)
    table = summarize(rows, block_size)
    print(f"\nstore costs, {args.blocks} blocks of {block_bytes} bytes (best of {args.repeats}):")
    print(f"{'store':>6} {'put ms/block':>13} {'get ms/block':>13} {'get MB/s':>9}")
    for name, c in costs.items():
        mbps = args.blocks * block_bytes / c["get_s"] / 1e6
        print(f"{name:>6} {c['put_s'] / args.blocks * 1e3:13.3f} "
              f"{c['get_s'] / args.blocks * 1e3:13.3f} {mbps:9.0f}")  # fmt: skip
    print("\nlater turns (TTFT, s; p99 by nearest rank):")
    print(f"{'history':>7} {'turns':>5} {'recompute p50':>13} {'tiers p50':>9} {'ratio':>6} "
          f"{'recompute p99':>13} {'tiers p99':>9} {'shared hits':>11} "
          f"{'B/token saved':>13}")  # fmt: skip
    for r in table:
        rate = "-" if r["shared_hit_rate"] is None else f"{r['shared_hit_rate']:.3f}"
        print(f"{r['history']:>7} {r['later_turns']:>5} {r['recompute_p50_s']:13.3f} "
              f"{r['tiers_p50_s']:9.3f} {r['ratio_p50']:6.3f} {r['recompute_p99_s']:13.3f} "
              f"{r['tiers_p99_s']:9.3f} {rate:>11} {r['bytes_per_token_saved']:13.0f}")  # fmt: skip
    equal = all(r.get("greedy_equal", True) for r in rows)
    print(f"\ngreedy answers equal with and without tiers: {equal}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "store_costs": costs,
                                          "table": table, "rows": rows,
                                          "block_bytes": block_bytes}, indent=1))  # fmt: skip
    plot(rows, Path(args.png))


if __name__ == "__main__":
    main()
