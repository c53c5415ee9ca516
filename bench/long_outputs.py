"""Long outputs through the engine process: bytes per step message and tokens/s vs offline.

One tiny random Llama (tests/utils/factories), `--concurrency` requests of `--tokens` greedy
tokens each (ignore_eos). Prints the bytes the engine process sent the server per step
(median of the step messages around token 100 and around token `--late`; a step message
carries every running request's output, and now and then a stats snapshot, hence medians)
and generated tokens/s through `EngineProcess` against the offline `LLM` doing the same work
(`--repeats` alternates the two, ABBA, and takes each one's median: the machine is shared).

    .venv/bin/python -m bench.long_outputs                        # 1 request x 4,096 tokens
    .venv/bin/python -m bench.long_outputs --tokens 8192 --late 8000
    .venv/bin/python -m bench.long_outputs --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _offline(model: str, n: int, tokens: int) -> float:
    from loraplex.engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * n, params)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return n * tokens / seconds


def _served(model: str, n: int, tokens: int) -> tuple[float, list[int]]:
    from loraplex.engine import EngineConfig, SamplingParams
    from loraplex.engine.engine_process import EngineProcess

    engine = EngineProcess(EngineConfig(model, dtype="float32"))

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
        return n * tokens / seconds, list(engine.step_bytes)
    finally:
        engine.shutdown()


def _around(sizes: list[int], token: int, width: int = 10) -> float:
    """Median bytes of the step messages that carried token `token` (+- width) of each request:
    step message k carries token k + 1 (the prompt's prefill step yields the first token)."""
    return statistics.median(sizes[max(0, token - 1 - width) : token + width])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--early", type=int, default=100)
    ap.add_argument("--late", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    assert args.early < args.late < args.tokens, "need early < late < tokens"

    from loraplex.bench.assets import import_installed_kernels

    import_installed_kernels()  # before transformers, or our kernels/ folder stands in for it
    from tests.utils.factories import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=args.tokens + 64)
        )
        served_runs, offline_runs = [], []
        for i in range(args.repeats):
            for which in ("served", "offline") if i % 2 == 0 else ("offline", "served"):
                if which == "served":
                    rate, sizes = _served(model, args.concurrency, args.tokens)
                    served_runs.append(rate)
                else:
                    offline_runs.append(_offline(model, args.concurrency, args.tokens))
    served, offline = statistics.median(served_runs), statistics.median(offline_runs)
    early, late = _around(sizes, args.early), _around(sizes, args.late)
    n, t = args.concurrency, args.tokens
    print(f"work: {n} request(s) x {t} tokens, tiny random llama, float32, greedy, ignore_eos")
    print(f"engine -> server bytes per step at token {args.early}: {early:,.0f}")
    print(f"engine -> server bytes per step at token {args.late}: {late:,.0f}")
    print(f"  ratio late/early: {late / early:.2f}  (goal <= 1.2)")
    print(f"  all step messages: {sum(sizes):,} bytes in {len(sizes)} messages")
    print(f"tokens/s through the engine process: {served:,.1f}")
    print(f"tokens/s through the offline LLM:    {offline:,.1f}")
    print(f"  ratio served/offline: {served / offline:.2f}  (goal >= 0.9)")
    if args.repeats > 1:
        print(
            f"  runs: served {[round(r, 1) for r in served_runs]}, offline "
            f"{[round(r, 1) for r in offline_runs]}"
        )


if __name__ == "__main__":
    main()
