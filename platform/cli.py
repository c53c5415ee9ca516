"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine import LLM, LoRARequest, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_lora_rank=args.max_lora_rank,
        progress=True,
        max_model_len=args.max_model_len,
    )
    load_s = time.perf_counter() - t0
    lora = LoRARequest("adapter", 1, args.adapter) if args.adapter else None
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    t1 = time.perf_counter()
    out = llm.generate([args.prompt], params, lora)[0].outputs[0]
    gen_s = time.perf_counter() - t1
    print(args.prompt + out.text)
    print(
        f"[{len(out.token_ids)} tokens in {gen_s:.2f}s ({len(out.token_ids) / gen_s:.1f} tok/s), "
        f"finish={out.finish_reason}, load {load_s:.1f}s]",
        file=sys.stderr,
    )
    return 0


def _prepare_demo(args: argparse.Namespace) -> int:
    from loraplex.engine.demo import prepare_demo

    print(prepare_demo(args.data_dir, dtype=args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description="multi-tenant LoRA serving")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation offline")
    g.add_argument("prompt")
    g.add_argument("--model", default="demo", help="model folder, or 'demo' (Gemma 3 270M)")
    g.add_argument("--adapter", help="PEFT adapter folder to apply")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.set_defaults(func=_generate)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    d = msub.add_parser("prepare-demo", help="convert the bundled Gemma 3 270M (once)")
    d.add_argument("--data-dir", default=None)
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.set_defaults(func=_prepare_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
