"""`python -m bench.quant`: weight-only formats side by side on the demo model (Gemma 3 270M).

Per format: held-out perplexity (tests/engine/heldout_texts.py, the texts the int4/int8 tests
bound), its ratio to float, greedy (argmax) agreement with float at every position, and the
resident weight bytes. Everything runs in float32 on the exact reference path (dispatch
"reference"): the figures measure the weights' quantization error alone.

Peers are run through their own quantize / dequantize math and the dequantized weights served
by our float engine (same text, same forward): HQQ (`hqq`, half-quadratic zero/scale
optimisation, its default int4 config), torchao's int4 weight-only scheme (its tinygemm
affine primitives: torchao 0.18's Int4WeightOnlyConfig has no CPU kernel here). Their bytes are
computed (4-bit codes plus fp16 scale and zero per group, the rest float32), ours measured
(`resident_weight_bytes`; float32 holds the tied embedding twice, once packed for oneDNN).
gptqmodel is not run: its wheel pulls a CUDA torch build (torch 2.14.1 + nvidia-*), which
this CPU-only environment pins out. Run from a checkout:

    python -m bench.quant --model DATA_DIR/models/gemma-3-270m --out bench/results/quant-demo.json
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

from loraplex.engine import LLM
from loraplex.engine.models.layers import AttentionMetadata, ForwardContext
from loraplex.engine.quantization import quantize_int4, resident_weight_bytes
from loraplex.kernels import dispatch
from loraplex.kernels.reference import dequantize_int4


def _llm(model: Path, quantization: str | None) -> LLM:
    return LLM(
        str(model), dtype="float32", quantization=quantization, max_model_len=512,
        kv_cache_bytes=128 << 20, max_lora_rank=8, max_loras=1,
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


@torch.inference_mode()
def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model, n = llm.engine.model, len(ids)
    blocks = -(-n // llm.engine.config.block_size)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=torch.arange(blocks).unsqueeze(0),
    )  # fmt: skip
    hidden = model(torch.tensor(ids), torch.arange(n), ForwardContext(attn=attn, lora=None))
    return model.compute_logits(hidden).float()


def measure(llm: LLM, texts: list[str]) -> tuple[float, torch.Tensor]:
    nll, n, argmax = 0.0, 0, []
    for text in texts:
        ids = llm.get_tokenizer().encode(text)
        logits = _logits(llm, ids)
        nll += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n, argmax = n + len(ids) - 1, [*argmax, logits.argmax(-1)]
    return math.exp(nll / n), torch.cat(argmax)


def run(model: Path, names: list[str]) -> list[dict]:
    from tests.engine.heldout_texts import HELDOUT_TEXTS  # checkout only: the tests' texts

    dispatch.set_mode("reference")
    rows, base = [], None
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
            ppl, argmax = measure(llm, list(HELDOUT_TEXTS))
            if base is None:
                base = (ppl, argmax)
            row = {
                "format": name, "perplexity": ppl, "ratio": ppl / base[0],
                "greedy_agreement": (argmax == base[1]).float().mean().item(),
                "weight_bytes": nbytes, "bytes_computed": computed is not None,
                "seconds": time.perf_counter() - start,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            del llm
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| format | held-out perplexity | ratio to float | greedy agreement | weights (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mib = f"{r['weight_bytes'] / 2**20:.0f}" + (" (computed)" if r["bytes_computed"] else "")
        lines.append(
            f"| {r['format']} | {r['perplexity']:.3f} | x{r['ratio']:.4f} | "
            f"{r['greedy_agreement']:.3f} | {mib} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["weight_bytes"] / 2**20, r["ratio"], s=40)
        ax.annotate(r["format"], (r["weight_bytes"] / 2**20, r["ratio"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("resident weights (MiB)")
    ax.set_ylabel("held-out perplexity / float32")
    ax.set_title("Gemma 3 270M: weight-only formats (float32 activations)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="converted demo model folder")
    p.add_argument("--formats", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=Path("bench/results/quant-demo.json"))
    p.add_argument("--plot", type=Path, help="PNG (default: --out with .png, what docs link)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = run(args.model, args.formats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from loraplex.bench.sysinfo import machine

    doc = {"kind": "quant", "model": str(args.model), "machine": machine(), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    print(table(rows))
    plot(rows, args.plot or args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
