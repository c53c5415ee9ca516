"""`python -m benchmarks.moe`: expert LoRA on a mixture-of-experts base, and our MoE forward
against transformers', on a tiny random Qwen3-MoE shaped like Qwen3-30B-A3B.

Goal (issue 35): at batch 32 on the CPU, 32 expert adapters (rank 16) keep >= 0.85 of the base
model's decode tokens/s.

The model keeps Qwen3-30B-A3B's ratios at tiny widths: 128 experts, top 8 (renormalised),
expert width / hidden = 0.375 (768 / 2048 there, 96 / 256 here), 8 query heads per KV head
(32 / 4 there), every layer routed; 4 layers, vocab 2048, random weights (seed 0), bf16 on disk
(the engine computes in float32 on a CPU without bf16 matmul instructions, and says so).

Adapters: PEFT LoRA, alpha 2 x rank, on the experts only (`target_parameters` gate_up_proj and
down_proj, as peft 0.17+ trains transformers 5's fused experts): per routed layer 128 experts x
rank of each projection. The first is written by peft itself; the others copy its config and
draw their own A and B. Rank 16 is the issue's; rank 2 keeps Qwen3-30B-A3B's rank / hidden
(16 / 2048 = 2 / 256): a rank does not shrink with the model, so at tiny widths rank 16 weighs
8 times more against the experts than on the real model.

`--widths a3b` builds the same model at Qwen3-30B-A3B's own widths (hidden 2048, expert
width 768, 32 query / 4 KV heads of 128) in 2 routed layers: every ratio of the real model,
rank / hidden included (about 2.5 GB of bf16 experts; with `--doc docs/moe-a3b.md`).

Decode: 32 requests of 16 random prompt tokens and `--tokens` greedy tokens each (ignore_eos),
all submitted at once to one engine with 32 adapter slots (one engine per rank, one torch
thread by default: the machine may be shared); decode tokens/s counts from the
step after which every request has its first token (prefill done) to the last token. Rows
use no adapter (base), 4 adapters (8 rows each) or 32 (one each). The adapters are loaded into
their slots by a warm-up run first, so no run pays for loading; the scenarios alternate in
every repeat (ABC, CBA, ...), each repeat with fresh prompts; the figure is the median, the
ratio the median scenario tokens/s over the median base tokens/s.

Where the time goes (layer_times, per rank): the routed layers' experts of one decode step with
32 adapters run alone on its captured inputs, with and without their adapters, caches flushed
before each run, in CPU time of the benchmark's thread (which a shared machine's other
processes do not add to); with the bytes each side reads (layer_bytes), their read rates and
the rate the adapters' bytes would need for the goal.

Forward: the same weights in transformers (its default experts implementation, and its eager
loop over experts) and in our engine, in the engine's compute dtype: the MoE layer alone at
32 tokens (a decode step of batch 32) and 512 tokens (batch 32 x 16-token prefill), and the
whole model's prefill of that batch (ours: one engine step that prefills the 32 prompts and
samples a token each; transformers: one forward of [32, 16]). Tokens/s = tokens / median time.

    python -m benchmarks.moe                 # writes docs/moe.md and docs/moe.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks._cli import parser, require
from benchmarks.assets import CACHE_DIR, REPO_ROOT, factories, import_installed_kernels
from benchmarks.contention import OthersMeter
from benchmarks.options import cpu_info

GOAL = 0.85  # 32 expert adapters' decode tokens/s over the base's, batch 32, CPU
BATCH, PROMPT = 32, 16
EXPERTS = ("gate_up_proj", "down_proj")
# Qwen3-30B-A3B: hidden 2048, expert width 768, 32 query / 4 KV heads of 128, 128 experts,
# top 8, 48 layers. The same ratios at tiny widths:
TINY_A3B = dict(
    vocab_size=2048,
    num_layers=4,
    hidden_size=256,
    moe_intermediate_size=96,
    intermediate_size=768,  # unused: every layer is routed (mlp_only_layers empty)
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=32,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    mlp_only_layers=[],
    max_position_embeddings=2048,
    initializer_range=0.02,
)
# Qwen3-30B-A3B's own widths (its attention, 128 experts of 768 at hidden 2048, top 8) in 2
# routed layers: every ratio of the real model, rank / hidden included, which the tiny widths
# keep for everything but a rank (about 1.2 GB of experts per layer in bf16)
A3B_WIDTHS = dict(TINY_A3B, num_layers=2, hidden_size=2048, moe_intermediate_size=768,
                  intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128)  # fmt: skip
SHAPES = {"tiny": TINY_A3B, "a3b": A3B_WIDTHS}
FOLDERS = {"tiny": "moe-a3b-tiny", "a3b": "moe-a3b-widths"}
KV_CACHE_GIB = {"tiny": 3.0, "a3b": 6.0}  # KV cache + 32 slots' expert stacks (2.5 GiB at a3b)
_DONE = ".complete"


def build_model(cache: Path, widths: str = "tiny") -> Path:
    """The Qwen3-30B-A3B-shaped model of `widths` (SHAPES), built once (float32 by the
    factory, stored bf16)."""
    out = cache / FOLDERS[widths]
    if (out / _DONE).is_file():
        return out
    import transformers

    tmp, f32 = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".f32")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(f32, ignore_errors=True)
    factories().make_tiny_model("qwen3_moe", f32, seed=0, **SHAPES[widths])
    model = transformers.AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16)
    # into a folder of its own: saved over the float32 files, a sharded float32 index would
    # stay beside bf16 files it does not name
    model.save_pretrained(tmp, safe_serialization=True)
    for file in f32.iterdir():  # the tokenizer's files
        if "safetensors" not in file.name and not (tmp / file.name).exists():
            shutil.copy(file, tmp / file.name)
    shutil.rmtree(f32)
    (tmp / _DONE).write_text("random weights, seed 0\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_adapters(base: Path, count: int, rank: int, cache: Path) -> list[Path]:
    """`count` expert adapters (see the module doc), cached beside the model."""
    from safetensors.torch import load_file, save_file

    root = cache / f"{base.name}-experts-r{rank}"
    first = root / "e00"
    if not (first / _DONE).is_file():
        shutil.rmtree(first, ignore_errors=True)
        factories().make_adapter(base, first, r=rank, alpha=2 * rank, targets=(),
                                 target_parameters=EXPERTS, init_std=0.05, seed=0)  # fmt: skip
        cfg_path = first / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        # peft writes `target_modules: []` for an adapter on parameters only; the engine
        # refuses an empty list today, and null (no module targets) means the same here
        if cfg.get("target_modules") == []:
            cfg["target_modules"] = None
            cfg_path.write_text(json.dumps(cfg, indent=2))
        (first / _DONE).write_text("peft\n")
    tensors = load_file(first / "adapter_model.safetensors")
    out = [first]
    for i in range(1, count):
        folder = root / f"e{i:02d}"
        if not (folder / _DONE).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(first / "adapter_config.json", folder)
            gen = torch.Generator().manual_seed(i)
            drawn = {k: (0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)
                     for k, v in tensors.items()}  # fmt: skip
            save_file(drawn, folder / "adapter_model.safetensors")
            (folder / _DONE).write_text("random\n")
        out.append(folder)
    return out


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = TINY_A3B["vocab_size"]
    return [torch.randint(16, vocab, (PROMPT,), generator=gen).tolist() for _ in range(BATCH)]


def decode_run(llm, prompts, loras, max_tokens: int) -> dict:
    """One batch through the engine's steps; decode tokens/s after every prefill is done."""
    from loraplex.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"moe-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras, strict=True):
        engine.add_request(rid, prompt, params, lora)
    started: set[str] = set()
    finished, t_decode, steps = 0, None, 0
    with OthersMeter() as others:
        t0 = time.perf_counter()
        while finished < len(ids):
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
                finished += out.finished
            if t_decode is None and len(started) == len(ids):
                t_decode, steps = time.perf_counter(), 0
            steps += 1
        t_end = time.perf_counter()
    decoded = len(ids) * (max_tokens - 1)
    return {"decode_tok_s": decoded / (t_end - t_decode), "decode_steps": steps - 1,
            "prefill_s": t_decode - t0, "others_cores": others.cores}  # fmt: skip


def decode_figures(args, base: Path, adapters: list[Path], rank: int) -> dict:
    from loraplex.engine import LLM, LoRARequest

    llm = LLM(str(base), dtype=args.dtype, max_loras=max(args.adapters), max_lora_rank=rank,
              max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT,
              max_model_len=PROMPT + args.tokens + 16, enable_prefix_caching=False,
              num_threads=args.threads, kv_cache_bytes=args.kv_cache_gib * 2**30)  # fmt: skip
    requests = [LoRARequest(f"e{i:02d}", i + 1, str(p)) for i, p in enumerate(adapters)]
    rows = {n: [None] * BATCH if n == 0 else [requests[i % n] for i in range(BATCH)]
            for n in args.adapters}  # fmt: skip
    for n, loras in rows.items():  # warm-up: every adapter into its slot
        decode_run(llm, _prompts(10_000 + n), loras, 4)
    runs: dict[int, list[dict]] = {n: [] for n in rows}
    order = list(rows)
    for r in range(args.repeats):
        for n in order if r % 2 == 0 else order[::-1]:
            runs[n].append(decode_run(llm, _prompts(r), rows[n], args.tokens))
            print(f"  rank {rank} repeat {r}: {n:>2} adapters "
                  f"{runs[n][-1]['decode_tok_s']:8.1f} tok/s", flush=True)  # fmt: skip
    base_tok_s = statistics.median(x["decode_tok_s"] for x in runs[0])
    out = []
    for n, rs in runs.items():
        tok_s = statistics.median(x["decode_tok_s"] for x in rs)
        out.append({"adapters": n, "decode_tok_s": tok_s, "vs_base": tok_s / base_tok_s,
                    "runs_tok_s": [x["decode_tok_s"] for x in rs],
                    "others_cores": statistics.median(x["others_cores"] for x in rs)})  # fmt: skip
    manager = llm.engine.adapters
    info = {"compute_dtype": str(next(llm.engine.model.parameters()).dtype).replace("torch.", ""),
            "expert_slot_mib": manager.expert_slot_bytes() / 2**20,
            "threads": torch.get_num_threads(), "rank": rank,
            "layers": layer_times(llm, rows[max(rows)], args.repeats * 10)}  # fmt: skip
    manager.close()
    return {"rows": out, **info}


def layer_times(llm, loras: list, repeats: int) -> dict:
    """Where a decode step's time goes: the routed layers' experts (router excluded) of one
    decode step of batch 32 with `loras`, run alone on its captured inputs without their
    adapters and with them, the two alternating, caches flushed before each run; CPU time of
    this thread (a shared machine's other processes do not add to it), median ms of all the
    layers together."""
    from loraplex.engine import SamplingParams
    from loraplex.engine.models import moe

    engine, captured, real = llm.engine, [], moe.Experts.forward

    def capture(self, x, experts, weights, lora):
        captured.append((self, x.clone(), experts.clone(), weights.clone(), lora))
        return real(self, x, experts, weights, lora)

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(_prompts(20_000), loras, strict=True)):
        engine.add_request(f"layers-{i}", prompt, params, lora)
    engine.step()  # the prefill
    moe.Experts.forward = capture
    try:
        engine.step()  # one decode step
    finally:
        moe.Experts.forward = real
    while engine.has_unfinished():
        engine.step()
    flush = torch.empty(64 * 2**20 // 4)
    times: dict[str, list[float]] = {"base": [], "lora": []}
    with torch.inference_mode():
        for r in range(repeats):
            for name in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
                flush.fill_(r)
                t = time.thread_time()
                for ex, x, experts, weights, lora in captured:
                    ex(x, experts, weights, lora if name == "lora" else None)
                times[name].append(time.thread_time() - t)
    return {"count": len(captured), **{k: 1e3 * statistics.median(v) for k, v in times.items()}}


def layer_bytes(rank: int, elsize: int, shape: dict) -> dict:
    """Bytes one routed layer reads in a decode step of batch 32 (shapes only): the experts'
    weights (each expert some row picked, on average) and, with a distinct adapter on every
    row, each (row, expert) pair's own A and B as the engine stacks them (gate|up 2 x rank
    wide, down rank wide)."""
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    picked = e * (1 - (1 - k / e) ** BATCH)
    experts = picked * 3 * h * i * elsize
    lora = BATCH * k * (2 * rank * (h + 2 * i) + rank * (i + h)) * elsize
    # what the engine reads of PEFT's fused adapters (one A for gate|up): the used width only
    read = BATCH * k * (rank * (h + 2 * i) + rank * (i + h)) * elsize
    return {"experts_mib": experts / 2**20, "lora_mib": lora / 2**20, "lora_read_mib": read / 2**20}


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """name -> (prepare, fn): median seconds of each fn, timed in turn within every round (the
    order reversed every other round), so that drift on a shared machine falls on all alike."""
    for prepare, fn in fns.values():
        prepare()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            prepare, fn = fns[name]
            prepare()  # untimed: which experts implementation transformers runs
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


@torch.inference_mode()
def forward_figures(args, base: Path, compute_dtype: torch.dtype) -> list[dict]:
    import transformers

    from loraplex.engine import LLM, SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=compute_dtype).eval()
    default = default_impl(hf)
    llm = LLM(str(base), dtype=args.dtype, max_loras=1, max_lora_rank=16,
              max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT,
              max_model_len=PROMPT + 16, enable_prefix_caching=False, expert_lora=False,
              num_threads=args.threads)  # fmt: skip
    ours_layer = llm.engine.model.model.layers[0].mlp
    hf_layer = hf.model.layers[0].mlp
    ours_dtype = ours_layer.experts.gate_up_proj.dtype
    gen = torch.Generator().manual_seed(1)

    def ours_side():
        pass

    def impl_of(impl: str):
        return lambda: hf.set_experts_implementation(impl)

    rows = []
    for tokens in (BATCH, BATCH * PROMPT):
        x = torch.randn(tokens, args.shape["hidden_size"], generator=gen)
        xo, xh = x.to(ours_dtype), x.to(compute_dtype).unsqueeze(0)
        fns = {"ours": (ours_side, lambda xo=xo: ours_layer(xo, None))}
        for name, impl in (("default", default), ("eager", "eager")):
            fns[name] = (impl_of(impl), lambda xh=xh: hf_layer(xh))
        rows.append({"what": f"MoE layer, {tokens} tokens", "tokens": tokens,
                     "seconds": _interleaved(fns, args.forward_repeats)})  # fmt: skip
    prompts = _prompts(7)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = torch.tensor(prompts)
    fns = {"ours": (ours_side, lambda: llm.generate(prompts, params))}
    for name, impl in (("default", default), ("eager", "eager")):
        fns[name] = (impl_of(impl), lambda: hf(input_ids=ids).logits[:, -1].argmax(-1))
    rows.append({"what": f"whole model, prefill {BATCH} x {PROMPT}", "tokens": BATCH * PROMPT,
                 "seconds": _interleaved(fns, args.forward_repeats)})  # fmt: skip
    llm.engine.adapters.close()
    for row in rows:
        row["tok_s"] = {k: row["tokens"] / s for k, s in row["seconds"].items()}
        row["hf_default_impl"] = default
    return rows


def default_impl(hf) -> str:
    """transformers' own choice of experts implementation when none is asked for."""
    return hf.get_correct_experts_implementation(None)


def _cpu_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    decodes = result["decode"]
    counts = [r["adapters"] for r in decodes[0]["rows"]]
    width = 0.8 / len(counts)
    colors = ["#888", "#4a90d9", "#1f5fa8", "#0b3b75"]
    for j, n in enumerate(counts):
        xs = [i + j * width for i in range(len(decodes))]
        rows = [next(r for r in d["rows"] if r["adapters"] == n) for d in decodes]
        bars = left.bar(xs, [r["vs_base"] for r in rows], width, color=colors[j % len(colors)],
                        label="base alone" if n == 0 else f"{n} expert adapters")  # fmt: skip
        for bar, r in zip(bars, rows, strict=True):
            left.annotate(f"{r['vs_base']:.2f}", (bar.get_x() + bar.get_width() / 2,
                          bar.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
    left.axhline(GOAL, ls="--", c="#c33", lw=1, label=f"goal: {GOAL} x base")
    left.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(decodes))])
    left.set_xticklabels([f"rank {d['rank']}\n(base {d['rows'][0]['decode_tok_s']:.0f} tok/s)"
                          for d in decodes])  # fmt: skip
    left.set_ylim(0, 1.45)
    left.set_ylabel("decode tokens/s over the base's")
    left.set_title(f"Expert LoRA, batch {BATCH}")
    left.legend(loc="upper center", fontsize=8, ncol=2)
    fwd = result["forward"]
    impls = list(fwd[0]["tok_s"])
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        name = "loraplex" if impl == "ours" else f"transformers ({_impl_name(fwd[0], impl)})"
        right.bar([i + j * width for i in range(len(fwd))], [r["tok_s"][impl] for r in fwd],
                  width, label=name)  # fmt: skip
    right.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(fwd))])
    right.set_xticklabels([r["what"].replace(", ", "\n") for r in fwd], fontsize=8)
    right.set_yscale("log")
    top = max(v for r in fwd for v in r["tok_s"].values())
    right.set_ylim(top=top * 6)  # room for the legend above the bars
    right.set_ylabel("tokens/s of a forward")
    right.set_title("MoE forward: loraplex vs transformers")
    right.legend(fontsize=8, loc="upper left")
    shape = result.get("shape", TINY_A3B)
    widths = f"hidden {shape['hidden_size']}, expert width {shape['moe_intermediate_size']}"
    fig.suptitle(f"Qwen3-30B-A3B-shaped MoE (128 experts, top 8; {widths}) on {result['cpu']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _impl_name(row: dict, impl: str) -> str:
    return f"default: {row['hf_default_impl']}" if impl == "default" else impl


def markdown(result: dict, png: str | None) -> str:
    decodes = result["decode"]
    first = decodes[0]
    shape = result.get("shape", TINY_A3B)  # runs before --widths measured the tiny model
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    tiny = shape["hidden_size"] == TINY_A3B["hidden_size"]
    model = (
        "a tiny random Qwen3-MoE with Qwen3-30B-A3B's ratios"
        if tiny
        else "a random Qwen3-MoE with Qwen3-30B-A3B's own widths (and so every ratio of it, "
        "rank / hidden included) in fewer layers"
    )
    lines = [
        "# Mixture of experts: expert LoRA and the MoE forward",
        "",
        "Measured with",
        "",
        "    " + result["command"],
        "",
        f"on `{result['cpu']}` ({result['cores']} cores, {first['threads']} torch thread(s); "
        f"the machine was shared: other processes kept {first['rows'][0]['others_cores']:.1f} "
        f"cores busy during the base runs), torch {result['torch']}, transformers "
        f"{result['transformers']}.",
        "",
        f"The model: {model} (128 experts, top 8, expert width / hidden = {i} / {h} = "
        f"{i / h:.3f}, {shape['num_attention_heads'] // shape['num_key_value_heads']} query "
        f"heads per KV head, every layer routed, {shape['num_layers']} layers, vocab "
        f"{shape['vocab_size']}), bf16 on "
        f"disk, computed in {first['compute_dtype']}. Expert adapters: PEFT `target_parameters` "
        "on both expert projections. benchmarks/moe.py's docstring has the method.",
        "",
        f"## Decode, batch {BATCH} ({result['tokens']} tokens per request, median of "
        f"{result['repeats']} alternating repeats)",
        "",
        "| rank | rows | decode tok/s | vs base | runs (tok/s) |",
        "| ---: | --- | ---: | ---: | --- |",
    ]
    for d in decodes:
        for r in d["rows"]:
            name = "base alone" if r["adapters"] == 0 else f"{r['adapters']} expert adapters"
            runs = ", ".join(f"{x:.0f}" for x in r["runs_tok_s"])
            lines.append(f"| {d['rank']} | {name} | {r['decode_tok_s']:.0f} | "
                         f"{r['vs_base']:.2f} | {runs} |")  # fmt: skip
    if "compare" in result:
        lines += _compare_lines(result)
    lines += ["", f"Goal: {max(result['adapters'])} expert adapters of rank 16 keep >= {GOAL} of "
              "the base's decode tokens/s at batch 32."]  # fmt: skip
    for d in decodes:
        last = d["rows"][-1]
        verdict = "met" if last["vs_base"] >= GOAL else "not met"
        slot = d["expert_slot_mib"] / result["max_loras"]
        lines.append(f"Rank {d['rank']}: **{verdict}** ({last['vs_base']:.2f}); one slot's "
                     f"expert stacks take {slot:.1f} MiB.")  # fmt: skip
    elsize = 4 if first["compute_dtype"] == "float32" else 2
    lines += [
        "",
        f"What a routed layer reads in one decode step of batch {BATCH} (from the shapes, in "
        f"{first['compute_dtype']}), with a distinct adapter on every row, so that each of the "
        f"{BATCH * shape['num_experts_per_tok']} (row, expert) pairs has its own A and B:",
        "",
        "| rank | experts' weights | expert LoRA | LoRA / experts | at Qwen3-30B-A3B's widths |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in decodes:
        b = layer_bytes(d["rank"], elsize, shape)
        real = a3b_lora_share(d["rank"])
        lines.append(f"| {d['rank']} | {b['experts_mib']:.1f} MiB | {b['lora_mib']:.1f} MiB | "
                     f"{b['lora_mib'] / b['experts_mib']:.2f} | {real:.3f} |")  # fmt: skip
    lines += [
        "",
        (
            "A rank does not shrink with the model, so at these tiny widths distinct rank-16 "
            "adapters read well over half the experts' own bytes again; at Qwen3-30B-A3B's own "
            "widths the same adapters add under a tenth (last column), and rank 2 is about that "
            "proportion here (`--widths a3b` measures those widths themselves). "
            if tiny
            else "At these widths, Qwen3-30B-A3B's own, the LoRA / experts column is the real "
            "model's proportion. "
        )
        + "The engine reads only each slot's used width of the gate|up stacks "
        "(twice the rank wide, for gate and up with an A each): PEFT's fused adapters share "
        "one A, so the columns read are about half the gate|up figures above.",
        "",
        "Where the time goes: a decode step of the table above (its median tokens/s over the "
        f"batch of {BATCH}); and the {first['layers']['count']} routed layers' experts of one "
        "decode step with 32 adapters (one per row; router excluded), run alone on the step's "
        f"captured inputs without their adapters and with them ({10 * result['repeats']} runs "
        "each, alternating, caches flushed before each run; median CPU time of the benchmark's "
        "thread, which other processes do not add to).",
        "",
        "| rank | decode step, base | with 32 adapters | experts, base "
        "| experts with adapters | adapters' part | that part over the base step "
        "| ratio it leaves |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in decodes:
        lay = d["layers"]
        base_ms, last_ms = (1e3 * BATCH / d["rows"][i]["decode_tok_s"] for i in (0, -1))
        extra = lay["lora"] - lay["base"]
        lines.append(f"| {d['rank']} | {base_ms:.1f} ms | {last_ms:.1f} ms | {lay['base']:.1f} ms "
                     f"| {lay['lora']:.1f} ms | {extra:.1f} ms | {extra / base_ms:.2f} "
                     f"| {base_ms / (base_ms + extra):.2f} |")  # fmt: skip
    lines += [
        "",
        "The experts take most of a base decode step. The adapters' part reads each row's "
        "A and B where they lie (embedding_bag; a narrow rank copies each row's A: "
        "kernels/cpu_moe.py's grouped_lora_rows); the bytes each side reads (from the shapes, the "
        "adapters' used width) over its time: "
        + "; ".join(_rates(d, elsize, shape) for d in decodes)
        + f". To keep {GOAL} of the base, the adapters' part may take {1 / GOAL - 1:.2f} of "
        "the base step, which asks of their bytes the rate named last."
        + "".join(_short(d, elsize, shape) for d in decodes),
        "",
        "## Forward: loraplex against transformers on the same weights",
        "",
    ]
    fwd = result["forward"]
    impls = list(fwd[0]["tok_s"])
    names = ["loraplex" if i == "ours" else f"transformers ({_impl_name(fwd[0], i)})"
             for i in impls]  # fmt: skip
    lines += ["| forward | " + " | ".join(f"{n} tok/s" for n in names)
              + " | loraplex / transformers default |",
              "| --- |" + " ---: |" * (len(impls) + 1)]  # fmt: skip
    for r in fwd:
        cells = " | ".join(f"{r['tok_s'][i]:.0f}" for i in impls)
        lines.append(
            f"| {r['what']} | {cells} | {r['tok_s']['ours'] / r['tok_s']['default']:.2f} |"
        )
    lines += [
        "",
        "The MoE layer alone: the router, top-k and the experts of layer 0 on random hidden "
        "states (ours without adapters). The whole model: ours is one engine step (prefill of "
        "the 32 prompts and a sampled token each, scheduling included); transformers' one "
        "forward and an argmax.",
    ]
    if png:
        lines += ["", f"![expert LoRA decode and MoE forward]({png})"]
    return "\n".join(lines) + "\n"


def _compare_lines(result: dict) -> list[str]:
    """This run's ratios beside an earlier run's (--compare), row by row."""
    cmp = result["compare"]
    lines = ["", f"Beside an earlier run ({cmp['label']}): `{cmp['command']}`", "",
             "| rank | rows | vs base, earlier run | vs base, this run |",
             "| ---: | --- | ---: | ---: |"]  # fmt: skip
    for d in result["decode"]:
        old = next((o for o in cmp["decode"] if o["rank"] == d["rank"]), None)
        for r in d["rows"][1:]:
            was = [o for o in (old or {"rows": []})["rows"] if o["adapters"] == r["adapters"]]
            before = f"{was[0]['vs_base']:.2f}" if was else "-"
            lines.append(f"| {d['rank']} | {r['adapters']} expert adapters | {before} | "
                         f"{r['vs_base']:.2f} |")  # fmt: skip
        if old and "layers" in old and "layers" in d:
            part = [x["layers"]["lora"] - x["layers"]["base"] for x in (old, d)]
            lines.append(f"| {d['rank']} | {d['rows'][-1]['adapters']} expert adapters: the "
                         f"adapters' part of the experts' time (below) | {part[0]:.1f} ms | "
                         f"{part[1]:.1f} ms |")  # fmt: skip
    return lines


def _short(d: dict, elsize: int, shape: dict) -> str:
    """A sentence for a rank whose adapters' bytes are read slower than the goal needs."""
    b, lay = layer_bytes(d["rank"], elsize, shape), d["layers"]
    base_step = 1e3 * BATCH / d["rows"][0]["decode_tok_s"]
    need = b["lora_read_mib"] / ((1 / GOAL - 1) * base_step)
    have = b["lora_read_mib"] / (lay["lora"] - lay["base"])
    experts, k = b["experts_mib"] / lay["base"], shape["num_experts_per_tok"]
    if have >= need:
        return ""
    return (f" Rank {d['rank']} would need its adapters' bytes read {need / have:.1f} times as "
            f"fast as they are, {need / experts:.1f} times the rate of the experts' own weights, "
            "while each row's A and B are already read once, in place: its bytes, not a fixed "
            "cost per layer, keep it under the goal. Fewer adapters save little of them: the "
            f"{BATCH * k} (row, expert) pairs of 4 adapters (8 rows each) still touch about "
            f"{_distinct(4, shape):.0f} distinct A and B on average, against "
            f"{_distinct(32, shape):.0f} "
            "for 32.")  # fmt: skip


def _distinct(adapters: int, shape: dict) -> float:
    """Expected distinct (adapter, expert) pairs of a decode step of batch 32 whose rows are
    spread evenly over `adapters` adapters, each row routed to top-k of the experts."""
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    return adapters * e * (1 - (1 - k / e) ** (BATCH / adapters))


def _rates(d: dict, elsize: int, shape: dict) -> str:
    """Rank d's read rates (GB/s) of the experts' weights and of the adapters' A and B."""
    b, lay = layer_bytes(d["rank"], elsize, shape), d["layers"]
    n, extra = lay["count"], lay["lora"] - lay["base"]
    scale = 2**20 * n / 1e9 * 1e3  # MiB per layer / ms -> GB/s over all layers
    lora_mib, base_step = b["lora_read_mib"], 1e3 * BATCH / d["rows"][0]["decode_tok_s"]
    return (f"rank {d['rank']}: experts {b['experts_mib'] * scale / lay['base']:.1f} GB/s, "
            f"adapters {lora_mib * scale / extra:.1f} GB/s ({lora_mib * n:.1f} MiB), "
            f"{lora_mib * scale / ((1 / GOAL - 1) * base_step):.1f} GB/s for the goal")  # fmt: skip


def a3b_lora_share(rank: int) -> float:
    """LoRA / experts bytes of a decode step of batch 32 at Qwen3-30B-A3B's own widths
    (hidden 2048, expert width 768), the same dtype on both sides."""
    b = layer_bytes(rank, 1, A3B_WIDTHS)
    return b["lora_mib"] / b["experts_mib"]


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 4, 32], help="adapter counts (0: base alone, first)")  # fmt: skip
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[16, 2],
                   help="adapter ranks, an engine each")  # fmt: skip
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="decode repeats per scenario")
    p.add_argument("--forward-repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache + adapter slots budget (default: 3 tiny, 6 a3b)")  # fmt: skip
    p.add_argument("--widths", choices=list(SHAPES), default="tiny",
                   help="tiny: the ratios at tiny widths; a3b: Qwen3-30B-A3B's own widths in 2 "
                   "layers (about 2.5 GB of experts in bf16, 2.5 GB of slots)")  # fmt: skip
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "moe.md")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cache", type=Path, default=CACHE_DIR)
    p.add_argument("--render", type=Path, default=None,
                   help="write the page from this --json file, measuring nothing")  # fmt: skip
    p.add_argument("--compare", type=Path, default=None,
                   help="an earlier run's --json: its decode ratios beside this run's")  # fmt: skip
    p.add_argument("--compare-label", default="earlier run",
                   help="what the earlier run measured (e.g. the commit)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__, _args).parse_args(argv)
    if args.render:
        result = _with_compare(json.loads(args.render.read_text()), args)
        write_page(result, args.doc, plot_it=not args.no_plot)
        return
    if args.adapters[0] != 0:
        raise SystemExit("error: --adapters must start with 0 (the base alone)")
    require("moe", adapters=True, plot=not args.no_plot)
    import_installed_kernels()  # before transformers / peft, from a checkout's root
    import transformers

    args.shape = SHAPES[args.widths]
    if args.kv_cache_gib is None:
        args.kv_cache_gib = KV_CACHE_GIB[args.widths]
    base = build_model(args.cache, args.widths)
    decode = []
    for rank in args.ranks:
        adapters = build_adapters(base, max(args.adapters), rank, args.cache)
        print(f"decode, batch {BATCH}, rank {rank}: adapters {args.adapters}", flush=True)
        decode.append(decode_figures(args, base, adapters, rank))
        for r in decode[-1]["rows"]:
            print(f"rank {rank}: {r['adapters']:>3} expert adapters {r['decode_tok_s']:8.1f} "
                  f"tok/s  {r['vs_base']:.2f} x base", flush=True)  # fmt: skip
    print("forward, loraplex vs transformers", flush=True)
    forward = forward_figures(args, base, getattr(torch, decode[0]["compute_dtype"]))
    for r in forward:
        cells = "  ".join(f"{k} {v:9.0f}" for k, v in r["tok_s"].items())
        print(f"{r['what']:<32} tok/s: {cells}")
    shown = " ".join(_measuring(argv or []))
    result = {
        "command": "python -m benchmarks.moe" + (f" {shown}" if shown else ""),
        "cpu": _cpu_line(),
        "cores": os.cpu_count(),
        "cpu_info": cpu_info(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "adapters": args.adapters,
        "max_loras": max(args.adapters),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "widths": args.widths,
        "shape": args.shape,
        "decode": decode,
        "forward": forward,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    write_page(_with_compare(result, args), args.doc, plot_it=not args.no_plot)


def _with_compare(result: dict, args) -> dict:
    """result with an earlier run's decode figures (--compare) beside its own."""
    if args.compare is None:
        return result
    earlier = json.loads(args.compare.read_text())
    return {**result, "compare": {"label": args.compare_label, "decode": earlier["decode"],
                                  "command": earlier["command"]}}  # fmt: skip


def _measuring(argv: list[str]) -> list[str]:
    """argv without the options that only say where the figures go."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--doc"):
            skip = True
        elif not a.startswith(("--json=", "--doc=")) and a != "--no-plot":
            out.append(a)
    return out


def write_page(result: dict, doc: Path, plot_it: bool) -> None:
    png = None
    if plot_it:
        require("moe", adapters=False)
        plot(result, doc.with_suffix(".png"))
        png = doc.with_suffix(".png").name
    doc.write_text(markdown(result, png))
    print(f"wrote {doc}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
