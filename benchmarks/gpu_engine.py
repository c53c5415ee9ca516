"""Engine decode throughput on an 8B-shaped random Llama, with and without 32 LoRA adapters.

    python -m benchmarks.gpu_engine                   # GPU: Llama-3-8B shapes, bf16, 32 x r16
    python -m benchmarks.gpu_engine --tiny --device cpu --batch 4 --steps 3   # code-path check

The base weights are random and built in device memory (no 16 GB checkpoint is written):
the folder holds only config.json and a tokenizer, and the engine's loader is swapped for one
that initialises the model in place. Adapters are real PEFT folders (q/k/v/o, random A and B).
Reports the median decode-step time, tokens/s, the LoRA overhead and the fraction of the HBM
roofline (weights + KV read once per step) reached. Writes
benchmarks/results/gpu-engine-b<batch>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.assets import CACHE_DIR, RESULTS_DIR, import_installed_kernels, make_adapters

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)  # fmt: skip
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def make_folder(shape: dict, name: str) -> Path:
    from testkit.factories import make_tokenizer

    out = CACHE_DIR / name
    if not (out / "tokenizer.json").is_file():
        make_tokenizer(out, vocab_size=shape["vocab_size"])
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama",
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1,
                  eos_token_id=2, hidden_act="silu", head_dim=shape["hidden_size"]
                  // shape["num_attention_heads"])  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def random_loader(folder, dtype, device="cpu", max_len=4096, progress=False, quantization=None):
    """Stand-in for engine.loader.load_model: the same model, random N(0, 0.02) weights."""
    from loraplex.engine.models.decoder import DecoderLM
    from loraplex.engine.models.spec import spec_from_config
    from loraplex.engine.weights.quantization import quantize_model

    spec = spec_from_config(json.loads((Path(folder) / "config.json").read_text()))
    with torch.device("meta"):
        model = DecoderLM(spec).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if quantization is not None:
        quantize_model(model, quantization)
    model.build_buffers(torch.device(device), max_len)
    return model.eval()


def decode_steps(llm, prompts, loras, steps: int) -> list[float]:
    """Seconds of each engine step once every sequence is decoding."""
    from loraplex.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    produced: dict[str, int] = {}
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, p, params, lora)
        produced[rid] = 0
    times, sync = [], torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    while engine.has_unfinished():
        decoding = min(produced.values()) > 0  # every prompt's prefill is done
        sync()
        start = time.perf_counter()
        outs = engine.step()
        sync()
        if decoding:
            times.append(time.perf_counter() - start)
        for out in outs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
    return times[1:] or times  # the first decode step warms up caches


def profile_steps(llm, prompts, loras_by_label: dict, steps: int = 6) -> None:
    """Where a decode step's time goes: host-side (launches, Python, syncs) vs device kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    for label, loras in loras_by_label.items():
        with profile(activities=activities) as prof:
            decode_steps(llm, prompts, loras, steps)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(f"--- profile {label}: {steps} decode steps after prefill")
        print(prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=60))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape (validate code paths)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="decode without CUDA graphs (captured on CUDA by default)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="the JSON report's path")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top ops over a few base and LoRA steps",
    )
    args = ap.parse_args()
    import_installed_kernels()  # before transformers looks for it and finds our kernels/
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny --device cpu to check the code paths")

    import loraplex.engine.llm_engine as llm_engine
    from loraplex.engine import LLM, LoRARequest

    shape = TINY if args.tiny else LLAMA_8B
    folder = make_folder(shape, "gpu-engine-tiny" if args.tiny else "gpu-engine-8b")
    adapter_dirs = make_adapters(folder, folder.name, args.adapters, rank=args.rank)
    llm_engine.load_model = random_loader  # the engine imported it by name
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    llm = LLM(str(folder), dtype=dtype, device=args.device, max_loras=args.adapters,
              max_lora_rank=args.rank, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
              max_model_len=args.prompt_len + args.steps + 16,
              kv_cache_bytes=(40 << 30) if args.device == "cuda" else (256 << 20),
              enforce_eager=True if args.enforce_eager else None)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]  # fmt: skip
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapter_dirs)]
    # Rows spread evenly over every adapter: at batch 64 and 32 adapters, 2 rows each.
    mixed = [reqs[i % len(reqs)] for i in range(args.batch)]
    results = {}
    for label, loras in (
        ("base", [None] * args.batch),
        ("lora", mixed),
        ("base2", [None] * args.batch),
    ):
        times = decode_steps(llm, prompts, loras, args.steps)
        results[label] = statistics.median(times)
    if args.profile:
        profile_steps(llm, prompts, {"base": [None] * args.batch, "lora": mixed})
    base = min(results["base"], results["base2"])  # base measured before and after
    lora = results["lora"]
    model = llm.engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    s = model.spec
    ctx = args.prompt_len + args.steps // 2
    kv_bytes = 2 * s.num_layers * args.batch * ctx * s.num_kv_heads * s.head_dim * 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = next((bw for k, bw in HBM_BYTES_PER_S.items() if k in name), None)
    report = {
        "device": name, "shape": shape, "batch": args.batch, "prompt_len": args.prompt_len,
        "adapters": args.adapters, "rank": args.rank,
        "graphs": llm.engine.runner.graphs is not None,
        "graph_replays": llm.engine.runner.graphs.replays if llm.engine.runner.graphs else 0,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "decode_step_ms": {"base": base * 1e3, "lora": lora * 1e3},
        "decode_tok_per_s": {"base": args.batch / base, "lora": args.batch / lora},
        "lora_overhead": lora / base - 1.0,
        "bytes_per_step": weight_bytes + kv_bytes,
        "roofline_fraction": (weight_bytes + kv_bytes) / base / peak if peak else None,
    }  # fmt: skip
    print(f"{name}: batch {args.batch}, context ~{ctx}, {args.adapters} adapters r{args.rank}")
    for k in ("base", "lora"):
        ms, tps = report["decode_step_ms"][k], report["decode_tok_per_s"][k]
        print(f"  decode step {k:5s} {ms:8.2f} ms   {tps:10.1f} tok/s")
    print(f"  LoRA overhead {report['lora_overhead'] * 100:+.1f}% (goal <= +15% at batch 64)")
    if peak:
        print(f"  HBM roofline {report['roofline_fraction'] * 100:.1f}% of {peak / 1e12:.1f} TB/s")
    tag = "tiny" if args.tiny else f"b{args.batch}"
    out = args.out or RESULTS_DIR / f"gpu-engine-{tag}{'-eager' if args.enforce_eager else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"  wrote {out}")


if __name__ == "__main__":
    main()
