"""`python -m benchmarks.kv_int8`: the int8 KV cache against the float cache on the demo model.

Figures, each int8 against the float cache in the same compute dtype:

- capacity: KV blocks the engine's pool gets from the same kv_cache_bytes, and from them the
  most requests of `--request-tokens` (prompt + output) that fit at once;
- held-out perplexity (testkit/heldout_texts.py, one forward per text as benchmarks.quant
  measures it; the keys and values are read back from the cache, so int8 shows) and its
  ratio, and teacher-forced greedy agreement (argmax equal at every position);
- free-running greedy agreement: `--prompts` prompts cut from those texts, `--max-tokens`
  greedy tokens each, the share of output positions where both caches gave the same token.

Run from a checkout (it reads the tests' held-out texts):

    python -m benchmarks.kv_int8 --model DATA_DIR/models/gemma-3-270m \
        --out benchmarks/results/kv-int8.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.quant import measure
from loraplex.engine import LLM, SamplingParams


def _llm(model: Path, dtype: str, kv: str, kv_bytes: int) -> LLM:
    return LLM(
        str(model), dtype=dtype, kv_cache_dtype=kv, max_model_len=4096, kv_cache_bytes=kv_bytes,
        max_lora_rank=8, max_loras=1, max_num_seqs=256, cpu_float32_compute=dtype == "float32",
    )  # fmt: skip


def _free_running(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def run(model: Path, dtypes: list[str], kv_bytes: int, request_tokens: int, n_prompts: int,
        max_tokens: int) -> list[dict]:  # fmt: skip
    from testkit.heldout_texts import HELDOUT_TEXTS  # checkout only: the held-out texts

    texts = list(HELDOUT_TEXTS)
    rows, float_argmax = [], {}
    for dtype in dtypes:
        base = None
        for kv in ("auto", "int8"):
            start = time.perf_counter()
            llm = _llm(model, dtype, kv, kv_bytes)
            runner = llm.engine.runner
            tok = llm.get_tokenizer()
            prompts = [tok.encode(texts[i % len(texts)])[:48] for i in range(n_prompts)]
            per_request = -(-request_tokens // llm.engine.config.block_size)
            ppl, argmax = measure(llm, texts)
            outs = _free_running(llm, prompts, max_tokens)
            if base is None:
                base = (ppl, argmax, outs)
                float_argmax[dtype] = argmax
            same = sum(a == b for x, y in zip(outs, base[2], strict=True)
                       for a, b in zip(x, y, strict=True))  # fmt: skip
            row = {
                "dtype": dtype, "kv_cache_dtype": kv, "kv_cache_bytes": runner.kv_cache_bytes,
                "num_blocks": runner.num_blocks,
                "tokens": runner.num_blocks * llm.engine.config.block_size,
                "max_concurrent_requests": runner.num_blocks // per_request,
                "request_tokens": request_tokens, "perplexity": ppl, "ppl_ratio": ppl / base[0],
                "teacher_forced_agreement": (argmax == base[1]).float().mean().item(),
                "free_running_agreement": same / sum(len(x) for x in outs),
                "free_running_tokens": sum(len(x) for x in outs),
                "seconds": time.perf_counter() - start,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            del llm
    if len(float_argmax) > 1:  # for scale: the float caches of two compute dtypes, same text
        (a, x), (b, y) = list(float_argmax.items())[:2]
        same = {f"{a} vs {b}": (x == y).float().mean().item()}
        for r in rows:
            r["float_cache_agreement_across_dtypes"] = same
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| compute | KV cache | KV MiB | tokens held | max concurrent requests | "
        "perplexity | ratio | greedy agreement (teacher-forced) | greedy agreement (free) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {}
    for r in rows:
        b = base.setdefault(r["dtype"], r)
        conc = f"{r['max_concurrent_requests']}"
        if r is not b:
            conc += f" (x{r['max_concurrent_requests'] / b['max_concurrent_requests']:.2f})"
        kv = r["dtype"] if r["kv_cache_dtype"] == "auto" else "int8 + fp16 scales"
        lines.append(
            f"| {r['dtype']} | {kv} | {r['kv_cache_bytes'] / 2**20:.0f} | {r['tokens']} | "
            f"{conc} | {r['perplexity']:.3f} | x{r['ppl_ratio']:.4f} | "
            f"{r['teacher_forced_agreement']:.4f} | {r['free_running_agreement']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="converted demo model folder")
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    p.add_argument("--kv-mib", type=int, default=256, help="kv_cache_bytes of both engines")
    p.add_argument("--request-tokens", type=int, default=4096, help="prompt + output")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kv-int8.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = run(args.model, args.dtypes, args.kv_mib << 20, args.request_tokens, args.prompts,
               args.max_tokens)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from loraplex.bench.sysinfo import machine

    doc = {"kind": "kv-int8", "model": str(args.model), "machine": machine(), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    print(table(rows))
    if "float_cache_agreement_across_dtypes" in rows[0]:
        print("teacher-forced agreement of the float caches across compute dtypes:",
              rows[0]["float_cache_agreement_across_dtypes"])  # fmt: skip


if __name__ == "__main__":
    main()
