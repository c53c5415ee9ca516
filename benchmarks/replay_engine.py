"""The trace of `loraplex bench serve` against our engine in-process (no HTTP, no server).

    python -m benchmarks.replay_engine --model tiny-llama --num-adapters 64 --rate inf

Same trace options and report as `loraplex bench serve`; writes
benchmarks/results/engine[-<tag>].json (+ .png).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.assets import RESULTS_DIR
from loraplex.bench.metrics import RequestResult
from loraplex.bench.serve import add_trace_args, model_vocab, report, trace_config
from loraplex.bench.trace import TraceRequest, make_trace


class EngineTarget:
    """Our AsyncLLMEngine in this process: the same trace without HTTP, auth or the registry
    (the `send` / `close` of `loraplex.bench.targets.HTTPTarget`)."""

    kind = "engine"

    def __init__(self, engine, adapter_dirs: list[Path]):
        from loraplex.engine import LoRARequest

        self.engine = engine
        self.loras = [LoRARequest(f"a{i:04d}", i + 1, str(p)) for i, p in enumerate(adapter_dirs)]

    @classmethod
    def build(cls, model_dir: Path, adapter_dirs: list[Path], **config) -> EngineTarget:
        """`config`: EngineConfig options (dtype, max_loras, max_num_seqs, …)."""
        from loraplex.engine import AsyncLLMEngine, EngineConfig, LLMEngine

        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(model_dir), **config)))
        return cls(engine, adapter_dirs)

    async def send(self, req: TraceRequest, t0: float) -> RequestResult:
        from loraplex.engine import SamplingParams

        def clock() -> float:
            return time.perf_counter() - t0

        result = RequestResult.sent(req, clock())
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        lora = None if req.adapter is None else self.loras[req.adapter]
        last = None
        try:
            async for out in self.engine.generate(list(req.prompt), params, lora_request=lora):
                now = clock()
                if out.delta_token_ids:
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.token_times.append(now)
                last = out
        except Exception as e:  # a bad request must not end the run: it is counted instead
            result.error = f"{type(e).__name__}: {e}"
        result.end_s = clock()
        if last is not None:
            result.output_tokens = len(last.outputs[0].token_ids)
            result.finish_reason = last.outputs[0].finish_reason
            result.usage_prompt_tokens = len(req.prompt)
        return result

    async def close(self) -> None:
        self.engine.shutdown()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-loras", type=int, default=8, help="adapter slots in the batch")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host LRU of adapters")
    p.add_argument("--max-lora-rank", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the generated adapters")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_trace_args(p)
    p.set_defaults(out=RESULTS_DIR)


def run_engine_replay(args: argparse.Namespace) -> dict:
    from benchmarks import assets
    from loraplex.bench.replay import run_replay

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_dir, adapters = assets.prepare(args.model, max(args.num_adapters, 1), rank=args.lora_rank)
    cfg = trace_config(args, model_vocab(model_dir))
    target = EngineTarget.build(
        model_dir,
        adapters[: args.num_adapters],
        dtype=args.dtype,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    results = run_replay(
        target,
        make_trace(cfg),
        max_concurrency=args.max_concurrency,
        progress=not args.no_progress,
        desc="replay_engine",
    )
    info = {
        "engine": "loraplex (in-process)",
        "model": str(model_dir),
        "dtype": args.dtype,
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "threads": args.threads,
    }
    return report("engine", info, cfg, results, args)  # offline.py writes "offline-*"


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    require("replay_engine", adapters=True, plot=not args.no_plot)
    doc = run_engine_replay(args)
    return 0 if doc["summary"]["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
