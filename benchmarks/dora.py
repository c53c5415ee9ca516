"""`python -m benchmarks.dora`: what serving DoRA adapters costs beside plain LoRA ones.

On the peer comparisons' tiny Llama (benchmarks.assets.tiny_llama: hidden 512, 4 layers),
adapters of rank 16 on every projection (q/k/v/o/gate/up/down), alpha 32, written by peft with
random A and B: four plain LoRA adapters, and four DoRA ones with the same A and B plus a
magnitude vector per module. `--rows` requests of 16 random prompt tokens decode `--tokens`
greedy tokens each (ignore_eos), all submitted at once to one engine with 8 adapter slots;
rows spread evenly over the scenario's adapters: all LoRA, all DoRA, or half and half. Decode
tokens/s counts from the step after which every request has its first token to the last token.
A warm-up run loads every adapter into its slot first; the scenarios alternate in every repeat
(ABC, CBA, ...) with fresh prompts; the figure is the median, the ratio a scenario's median
over all-LoRA's. One torch thread by default (the machine may be shared).

Also the load: the milliseconds a DoRA adapter's load spends on its factors m / ||W + B A||
(all modules), against the whole load of the same adapter.

    python -m benchmarks.dora                # prints the table (markdown)
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks._cli import parser, require
from benchmarks.assets import CACHE_DIR, factories, tiny_llama

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCENARIOS = ("lora", "dora", "half")


def _args(p) -> None:
    p.add_argument("--rows", type=int, default=16, help="requests decoded together")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")


def adapters(base) -> dict[str, object]:
    """name -> folder: lora0..3 and dora0..3 (dora<i> has lora<i>'s A and B)."""
    from testkit.dora import make_dora_adapter

    root = CACHE_DIR / "dora-adapters"
    out = {}
    for i in range(4):
        for kind, make in (("lora", factories().make_adapter), ("dora", make_dora_adapter)):
            folder = root / f"{kind}{i}"
            if not (folder / "adapter_model.safetensors").is_file():
                make(base, folder, r=16, alpha=32, targets=TARGETS, seed=i)
            out[f"{kind}{i}"] = folder
    return out


def decode_tps(llm, folders: dict, names: list[str], rows: int, tokens: int, seed: int) -> float:
    from loraplex.engine import LoRARequest, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    ids = {n: i + 1 for i, n in enumerate(sorted(folders))}
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = []
    for r in range(rows):
        name = names[r % len(names)]
        prompt = torch.randint(5, 500, (16,), generator=gen).tolist()
        rid = f"{seed}-{r}"
        engine.add_request(rid, prompt, params, LoRARequest(name, ids[name], str(folders[name])))
        reqs.append(rid)
    started, produced, t0 = False, 0, 0.0
    counts: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if not started and len(counts) == rows and all(counts.values()):
            started, produced, t0 = True, sum(counts.values()), time.perf_counter()
    return (sum(counts.values()) - produced) / (time.perf_counter() - t0)


def load_split(llm, folder) -> tuple[float, float]:
    """(seconds of a whole load, seconds of its DoRA factors) for one DoRA adapter."""
    from loraplex.engine.adapters.lora import dora_scales, load_adapter

    manager, spec = llm.engine.adapters, llm.engine.model.spec
    start = time.perf_counter()
    adapter = load_adapter(folder, spec, 16, manager.dtype)
    loaded = time.perf_counter()
    with torch.no_grad():
        dora_scales(adapter, manager._base_rows(), manager.dtype)
    done = time.perf_counter()  # the engine's loader thread does the same two steps (_read)
    return done - start, done - loaded


def main() -> None:
    args = parser(__doc__, _args).parse_args()
    require("dora", adapters=True, plot=False)
    torch.set_num_threads(args.threads)
    from loraplex.engine import LLM

    base = tiny_llama()
    folders = adapters(base)
    llm = LLM(str(base), dtype=args.dtype, max_loras=8, max_lora_rank=16,
              max_num_seqs=max(args.rows, 8))  # fmt: skip
    names = {
        "lora": [f"lora{i}" for i in range(4)],
        "dora": [f"dora{i}" for i in range(4)],
        "half": ["lora0", "dora1", "lora2", "dora3"],
    }
    decode_tps(llm, folders, sorted(folders), 8, 2, seed=0)  # every adapter into its slot
    tps: dict[str, list[float]] = {s: [] for s in SCENARIOS}
    for rep in range(args.repeats):
        order = SCENARIOS if rep % 2 == 0 else SCENARIOS[::-1]
        for s in order:
            tps[s].append(decode_tps(llm, folders, names[s], args.rows, args.tokens, 100 + rep))
    base_tps = statistics.median(tps["lora"])
    print(f"decode at {args.rows} rows, {args.tokens} tokens, {args.threads} thread(s), "
          f"{args.dtype}, median of {args.repeats}")  # fmt: skip
    print("| rows' adapters | decode tok/s | vs all LoRA |\n| --- | --- | --- |")
    labels = {"lora": "4 LoRA", "dora": "4 DoRA", "half": "2 LoRA + 2 DoRA"}
    for s in SCENARIOS:
        m = statistics.median(tps[s])
        print(f"| {labels[s]} | {m:.0f} | {m / base_tps:.3f} |")
    loads = [load_split(llm, folders["dora0"]) for _ in range(3)]
    whole, factors = (statistics.median(x) for x in zip(*loads, strict=True))
    print(f"\nDoRA adapter load: {whole * 1e3:.0f} ms, of which the factors {factors * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
