"""`python -m benchmarks.quant`: weight-only formats side by side on the demo model (Gemma 3 270M).

Per format: held-out perplexity (testkit/heldout_texts.py, the texts the int4/int8 tests
bound), its ratio to float, greedy (argmax) agreement with float at every position, and the
resident weight bytes. Everything runs in float32 on the exact reference path (dispatch
"reference"): the figures measure the weights' quantization error alone. Then the demo
adapters (trained on the float base) over each format (benchmarks/quant_adapters.py), and what
each format's smaller weights free at a fixed memory budget (benchmarks/quant_memory.py).

Peers are run through their own quantize / dequantize math and the dequantized weights served
by our float engine (same text, same forward): HQQ (`hqq`, half-quadratic zero/scale
optimisation, its default int4 config), torchao's int4 weight-only scheme (its tinygemm
affine primitives: torchao 0.18's Int4WeightOnlyConfig has no CPU kernel here). Their bytes are
computed (4-bit codes plus fp16 scale and zero per group, the rest float32), ours measured
(`resident_weight_bytes`; float32 holds the tied embedding twice, once packed for oneDNN).
gptqmodel is not run: its wheel pulls a CUDA torch build (torch 2.14.1 + nvidia-*), which
this CPU-only environment pins out. Run from a checkout (the held-out texts are the tests'):

    python -m benchmarks.quant --model DATA_DIR/models/gemma-3-270m \
        --out benchmarks/results/quant-demo.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from benchmarks import quant_memory
from benchmarks.quant_adapters import forward_logits, measure_adapters
from loraplex.engine import LLM
from loraplex.engine.step.model_runner import kv_block_bytes
from loraplex.engine.weights.quantization import quantize_int4, resident_weight_bytes
from loraplex.kernels.reference import dequantize_int4


def _llm(model: Path, quantization: str | None) -> LLM:
    return LLM(
        str(model), dtype="float32", quantization=quantization, max_model_len=512,
        kv_cache_bytes=128 << 20, max_lora_rank=8, max_loras=1, kernel_mode="reference",
    )  # fmt: skip


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_folder(model: Path, dst: Path, dequantized) -> int:
    """A copy of `model` with each linear weight W replaced by dequantized(W) (one checkpoint
    projection at a time, as a peer quantizes an nn.Linear); returns the weight bytes of that
    model served at 4 bits: linears as codes + fp16 scale and zero per group, every other
    tensor (embedding, tied head once, norms) in float32."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    total = 0
    for f in model.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith(".weight") and name.split(".")[-2] in PROJ:
                d, g = dequantized(w.float())
                tensors[name] = d.contiguous()  # float32: no second rounding to bf16
                n, k = w.shape
                total += n * k // 2 + n * (k // g) * 4
            else:
                total += w.numel() * 4
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
    return total


def _rtn(group: int):
    def deq(w: torch.Tensor):
        return dequantize_int4(*quantize_int4(w, group), group), group

    return deq


def _hqq(group: int):
    from hqq.core.quantize import BaseQuantizeConfig, Quantizer

    params = BaseQuantizeConfig(nbits=4, group_size=group, axis=1)["weight_quant_params"]

    def deq(w: torch.Tensor):
        q, meta = Quantizer.quantize(w, device="cpu", compute_dtype=torch.float32, **params)
        return Quantizer.dequantize(q, meta).float().view(w.shape), group

    return deq


def _torchao(group: int):
    from torchao.quantization import quant_primitives as qp

    def deq(w: torch.Tensor):
        args = ((1, group),)
        s, z = qp._choose_qparams_affine_tinygemm(
            w, qp.MappingType.ASYMMETRIC, *args, torch.int32, 0, 15, 1e-6, torch.float32,
            torch.float32,
        )  # fmt: skip
        q = qp._quantize_affine_tinygemm(w, *args, s, z, torch.int32, 0, 15)
        d = qp._dequantize_affine_tinygemm(
            q, *args, s, z, torch.int32, 0, 15, output_dtype=torch.float32
        )
        return d, group

    return deq


# name -> (engine quantization, dequantizing function for a float folder, or None)
VARIANTS = {
    "float32": (None, None),
    "RTN int4 g128 (min/max)": (None, lambda: _rtn(128)),
    "ours int4 g128 (Hadamard + GPTQ)": ("int4", None),
    "HQQ int4 g64": (None, lambda: _hqq(64)),
    "HQQ int4 g128": (None, lambda: _hqq(128)),
    "torchao int4 weight-only g128": (None, lambda: _torchao(128)),
    "ours int8": ("int8", None),
    "ours fp8 (e4m3, per channel)": ("fp8", None),
}


# peer format -> the package it runs (the `quant-peers` extra)
PEER_MODULES = {name: "hqq" for name in VARIANTS if name.startswith("HQQ")} | {
    name: "torchao" for name in VARIANTS if name.startswith("torchao")
}


def measure(llm: LLM, texts: list[str]) -> tuple[float, torch.Tensor]:
    nll, n, argmax = 0.0, 0, []
    for text in texts:
        ids = llm.get_tokenizer().encode(text)
        logits = forward_logits(llm, ids)
        nll += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n, argmax = n + len(ids) - 1, [*argmax, logits.argmax(-1)]
    return math.exp(nll / n), torch.cat(argmax)


def _heldout_texts() -> list[str]:
    """The held-out texts the int4/int8 tests bound (the lab runs from the checkout)."""
    from testkit.heldout_texts import HELDOUT_TEXTS

    return list(HELDOUT_TEXTS)


def run(
    model: Path, names: list[str], adapters: dict[str, Path] | None = None, on_row=None
) -> dict:
    """Rows per format (the first is the reference the others compare with: float32), and
    the fixed-budget memory table when adapters were given; `on_row(rows)` after each."""
    texts = _heldout_texts()
    rows, base, lora_ref, geometry = [], None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            quantization, make = VARIANTS[name]
            start = time.perf_counter()
            folder, computed = model, None
            if make is not None:
                folder = Path(tmp) / "dequantized"
                computed = dequantized_folder(model, folder, make())
            llm = _llm(folder, quantization)
            nbytes = computed or resident_weight_bytes(llm.engine.model)
            ppl, argmax = measure(llm, texts)
            if base is None:
                base = (ppl, argmax)
            row = {
                "format": name, "perplexity": ppl, "ratio": ppl / base[0],
                "greedy_agreement": (argmax == base[1]).float().mean().item(),
                "weight_bytes": nbytes, "bytes_computed": computed is not None,
            }  # fmt: skip
            if adapters:
                row["adapters"], own = measure_adapters(llm, adapters, lora_ref)
                lora_ref = lora_ref or own
            bs = llm.engine.config.block_size
            geometry = geometry or (kv_block_bytes(llm.engine.model, bs), bs)
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(json.dumps(row), flush=True)
            if on_row is not None:
                on_row(rows)
            del llm
    doc: dict = {"rows": rows}
    if adapters:
        adapter_bytes = max(a["adapter_bytes"] for a in rows[0]["adapters"].values())
        block_bytes, block_size = geometry
        doc["memory"] = {
            "extra_bytes": quant_memory.EXTRA,
            "budget_bytes": rows[0]["weight_bytes"] + quant_memory.EXTRA,
            "block_bytes": block_bytes, "block_size": block_size, "adapter_bytes": adapter_bytes,
            "rows": quant_memory.budget_rows(rows, block_bytes, block_size, adapter_bytes),
        }  # fmt: skip
    return doc


def table(rows: list[dict]) -> str:
    lines = [
        "| format | held-out perplexity | ratio to float | greedy agreement | weights (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mib = f"{r['weight_bytes'] / 2**20:.0f}" + (" (computed)" if r["bytes_computed"] else "")
        name = r["format"] + (f" (earlier run, {r['carried_from']})" if "carried_from" in r else "")
        lines.append(
            f"| {name} | {r['perplexity']:.3f} | x{r['ratio']:.4f} | "
            f"{r['greedy_agreement']:.3f} | {mib} |"
        )
    return "\n".join(lines)


def adapter_table(rows: list[dict]) -> str:
    """Per format and demo adapter: greedy agreement with float base + the same adapter on
    the adapter's answers, and the answers' perplexity ratio to it."""
    names = sorted(rows[0]["adapters"])
    head = (
        "| format | "
        + " | ".join(f"{n}: greedy agreement | {n}: answer ppl ratio" for n in names)
        + " |"
    )
    lines = [head, "| --- |" + " ---: | ---: |" * len(names)]
    for r in rows:
        got = r.get("adapters", {})  # rows carried from an earlier run have none: "-"
        cells = [f"{got[n]['greedy_agreement']:.3f} | x{got[n]['ratio']:.4f}" if n in got
                 else "- | -" for n in names]  # fmt: skip
        lines.append(f"| {r['format']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(doc: dict) -> str:
    """All of a results file's tables, as docs/benchmarks.md shows them."""
    parts = [table(doc["rows"])]
    if "adapters" in doc["rows"][0]:
        float_row = doc["rows"][0]["adapters"]
        scale = ", ".join(
            f"{n} {a['agreement_without_adapter']:.3f} ({a['answer_tokens']} answer tokens)"
            for n, a in sorted(float_row.items())
        )
        parts += [
            "LoRA on the quantized base: the demo adapters (trained on the float base), "
            "teacher-forced on their own answers. For scale, the float base without the "
            f"adapter agrees with float + adapter on: {scale}.",
            adapter_table(doc["rows"]),
        ]
    if "memory" in doc:
        parts += ["Memory at a fixed budget:", quant_memory.table(doc)]
    return "\n\n".join(parts)


def plot(doc: dict, path: Path) -> None:
    """Perplexity ratio vs weight bytes; the adapters' agreement; what fits at the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    panels = 1 + ("adapters" in rows[0]) + ("memory" in doc)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    ax = axes[0][0]
    for r in rows:
        ax.scatter(r["weight_bytes"] / 2**20, r["ratio"], s=40)
        ax.annotate(r["format"], (r["weight_bytes"] / 2**20, r["ratio"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("resident weights (MiB)")
    ax.set_ylabel("held-out perplexity / float32")
    ax.set_title("Gemma 3 270M: weight-only formats (float32 activations)", fontsize=9)
    ax.grid(alpha=0.3)
    labels = [r["format"] for r in rows]
    y = list(range(len(rows)))
    if "adapters" in rows[0]:
        ax = axes[0][1]
        names = sorted(rows[0]["adapters"])
        h = 0.8 / len(names)
        for i, n in enumerate(names):
            agree = [r.get("adapters", {}).get(n, {}).get("greedy_agreement", 0) for r in rows]
            ax.barh([v + i * h for v in y], agree, height=h, label=n)
        ax.set_yticks([v + h * (len(names) - 1) / 2 for v in y], labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("greedy agreement with float32 + the same adapter (answers)")
        ax.set_title("demo adapters on each base", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="x")
    if "memory" in doc:
        ax = axes[0][-1]
        m = doc["memory"]
        ax.barh(y, [r["kv_tokens"] / 1000 for r in m["rows"]])
        for v, r in zip(y, m["rows"], strict=True):
            ax.annotate(f"{r['adapters']:,} adapters", (r["kv_tokens"] / 1000, v), fontsize=7,
                        xytext=(3, -3), textcoords="offset points")  # fmt: skip
        ax.set_yticks(y, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("thousand KV tokens (float32) if all goes to KV")
        ax.set_title(f"fits in {m['budget_bytes'] / 2**20:.0f} MiB (float32 weights + "
                     f"{m['extra_bytes'] / 2**20:.0f} MiB)", fontsize=9)  # fmt: skip
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="converted demo model folder")
    p.add_argument("--formats", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--adapters", type=Path,
        help="folder of the demo adapters (pirate/, shout/); default: DATA_DIR/demo-adapters "
        "beside DATA_DIR/models, trained there first if missing (a few minutes)",
    )  # fmt: skip
    p.add_argument("--no-adapters", action="store_true", help="skip LoRA and memory tables")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quant-demo.json"))
    p.add_argument("--plot", type=Path, help="PNG (default: --out with .png, what docs link)")
    p.add_argument("--no-plot", action="store_true")


def _adapters(args: argparse.Namespace) -> dict[str, Path] | None:
    if args.no_adapters:
        return None
    from loraplex.platform.demo.adapters import prepare_demo_adapters

    out = args.adapters or args.model.resolve().parent.parent / "demo-adapters"
    return prepare_demo_adapters(args.model, out)


def run_quant(args: argparse.Namespace) -> dict:
    from loraplex.bench.sysinfo import machine

    torch.set_num_threads(2)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(doc: dict) -> dict:
        doc = {"kind": "quant", "model": str(args.model), "machine": machine(), **doc}
        args.out.write_text(json.dumps(doc, indent=2))
        return doc

    # Rows so far are kept as they come (a long run cut short still leaves them), marked partial.
    doc = run(args.model, args.formats, _adapters(args),
              on_row=lambda rows: save({"rows": rows, "partial": True}))  # fmt: skip
    doc = save(doc)
    print(tables(doc))
    if not args.no_plot:
        plot(doc, args.plot or args.out.with_suffix(".png"))
    return doc


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser, require

    args = parser(__doc__, add_args).parse_args(argv)
    peers = sorted({PEER_MODULES[f] for f in args.formats if f in PEER_MODULES})
    require("quant", adapters=False, plot=not args.no_plot, peers=tuple(peers))
    run_quant(args)


if __name__ == "__main__":
    main()
