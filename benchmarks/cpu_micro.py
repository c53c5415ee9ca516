"""CPU micro-measurements behind choices in the code (docs/benchmarks.md, "Measurements behind
choices in the code"): the figures once written in comments, measured again on this machine.

    python -m benchmarks.cpu_micro argmax          # engine/sampling/sampler.py `_argmax`
    python -m benchmarks.cpu_micro topk            # engine/sampling/sampler.py TOP_P_CANDIDATES
    python -m benchmarks.cpu_micro xgrammar   # engine/sampling/structured_output.py's lazy import
    python -m benchmarks.cpu_micro upcast          # engine/models/decoder.py compute_logits
    python -m benchmarks.cpu_micro gather          # kernels/reference.py gather_kv
    python -m benchmarks.cpu_micro gqa             # kernels/cpu.py _sdpa_folded
    python -m benchmarks.cpu_micro rotation        # engine/weights/quantization.py int4's rotation
    python -m benchmarks.cpu_micro int8-rows  # engine/weights/quantization.py INT8_PACKED_MAX_ROWS
    python -m benchmarks.cpu_micro packing         # engine/models/packing.py
    python -m benchmarks.cpu_micro half-matmul     # engine/config.py cpu_has_native_half
    python -m benchmarks.cpu_micro key-hash        # platform/security.py
    python -m benchmarks.cpu_micro expand          # kernels/cpu.py lora_apply's batched expand
    python -m benchmarks.cpu_micro all --threads 1

Each figure is the median of `--repeats` timed calls after a warm-up call, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def argmax(repeats: int) -> list[str]:
    """Index-tracking reductions against a plain amax, and the blocked argmax per width."""
    from loraplex.engine.sampling import sampler

    lines = []
    shapes = [(64, 32_000, torch.float32), (32, 262_144, torch.float32),
              (32, 32_000, torch.bfloat16), (32, 262_144, torch.bfloat16)]  # fmt: skip
    for rows, vocab, dtype in shapes:
        x = torch.randn(rows, vocab).to(dtype)
        shape = f"{rows} x {vocab} {str(dtype).removeprefix('torch.')}"
        lines.append(
            f"{shape}: argmax {_ms(lambda x=x: x.argmax(-1), repeats):.2f} ms, max(dim).indices "
            f"{_ms(lambda x=x: x.max(dim=-1).indices, repeats):.2f} ms, amax "
            f"{_ms(lambda x=x: x.amax(-1), repeats):.2f} ms, _argmax "
            f"{_ms(lambda x=x: sampler._argmax(x), repeats):.2f} ms"
        )
        widths = []
        for w in sampler._ARGMAX_BLOCKS:
            if vocab % w or vocab < 4 * w:
                continue
            saved = sampler._ARGMAX_BLOCKS
            sampler._ARGMAX_BLOCKS = (w,)
            try:
                widths.append(f"{w}: {_ms(lambda x=x: sampler._argmax(x), repeats):.2f}")
            finally:
                sampler._ARGMAX_BLOCKS = saved
        lines.append(f"  blocked argmax by block width (ms): {', '.join(widths)}")
    return lines


def topk(repeats: int) -> list[str]:
    """A full descending sort of each row against topk(TOP_P_CANDIDATES)."""
    from loraplex.engine.sampling.sampler import TOP_P_CANDIDATES

    lines = []
    for rows, vocab in ((32, 32_000), (32, 262_144)):
        x = torch.randn(rows, vocab)
        sort = _ms(lambda x=x: x.sort(dim=-1, descending=True), repeats)
        part = _ms(lambda x=x: x.topk(TOP_P_CANDIDATES, dim=-1), repeats)
        lines.append(
            f"{rows} x {vocab} float32: sort {sort:.2f} ms, topk({TOP_P_CANDIDATES}) "
            f"{part:.2f} ms (x{sort / part:.1f})"
        )
    return lines


def xgrammar(repeats: int) -> list[str]:
    """`import xgrammar` in a fresh interpreter, less the interpreter's own start."""

    def run(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0

    bare = statistics.median(run("import torch") for _ in range(repeats))
    full = statistics.median(run("import torch, xgrammar") for _ in range(repeats))
    return [f"import xgrammar (torch already imported): {(full - bare) * 1000:.0f} ms"]


def upcast(repeats: int) -> list[str]:
    """Upcasting a decode step's bf16 logits to float32 (engine/models/decoder.py)."""
    x = torch.randn(32, 262_144).to(torch.bfloat16)
    return [f"32 x 262144 bf16 logits .float(): {_ms(lambda: x.float(), repeats):.2f} ms"]


def gather(repeats: int) -> list[str]:
    """Whole KV blocks by index_select vs advanced indexing (kernels/reference.py gather_kv)."""
    cache = torch.randn(4096, 16, 2, 64).to(torch.bfloat16)  # blocks, block size, kv heads, d
    table = torch.randint(0, 4096, (64, 12))  # 64 sequences x 12 blocks
    flat = table.reshape(-1)
    sel = _ms(lambda: torch.index_select(cache, 0, flat), repeats)
    adv = _ms(lambda: cache[table], repeats)
    return [f"64 x 12 blocks of 16 x 2 x 64 bf16: index_select {sel:.3f} ms, "
            f"advanced indexing {adv:.3f} ms (x{adv / sel:.1f})"]  # fmt: skip


def gqa(repeats: int) -> list[str]:
    """sdpa's own grouped-query form (enable_gqa) vs the G query heads of a kv head folded
    into its query rows (kernels/cpu.py `_sdpa_folded`), with a boolean mask and with the
    additive one a step's plan builds, for one-token queries (the decode rows of a step that
    also prefills) and a prefill chunk; 8 / 2 heads of 64."""
    import torch.nn.functional as F

    from loraplex.kernels.cpu import _sdpa_folded

    lines = []
    for dtype in (torch.bfloat16, torch.float32):
        for b, n, length in ((63, 1, 96), (63, 1, 192), (1, 40, 40), (8, 4, 64)):
            q = torch.randn(b, n, 8, 64).to(dtype)
            k, v = (torch.randn(b, length, 2, 64).to(dtype) for _ in range(2))
            allowed = torch.arange(length) <= torch.arange(length - n, length).view(n, 1)
            allowed = allowed.expand(b, n, length)
            native = _ms(lambda q=q, k=k, v=v, m=allowed: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=m.unsqueeze(1), enable_gqa=True), repeats)  # fmt: skip
            folded = _ms(lambda q=q, k=k, v=v, m=allowed: _sdpa_folded(q, k, v, m, 0.125),
                         repeats)  # fmt: skip
            bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            additive = _ms(lambda q=q, k=k, v=v, m=bias: _sdpa_folded(q, k, v, m, 0.125),
                           repeats)  # fmt: skip
            lines.append(f"{str(dtype).removeprefix('torch.'):8s} {b} seqs x {n} rows over "
                         f"{length} keys: enable_gqa {native:.3f} ms, folded {folded:.3f} ms "
                         f"(x{native / folded:.1f}), folded with an additive mask "
                         f"{additive:.3f} ms")  # fmt: skip
    return lines


def rotation(repeats: int) -> list[str]:
    """int4's Hadamard rotation of one row in float32 vs bf16 (engine/weights/quantization.py)."""
    from loraplex.engine.weights.rotation import hadamard, rotate_groups

    lines = []
    for rows in (1, 32):
        x, h = torch.randn(rows, 640), hadamard(128)
        f32 = _ms(lambda x=x, h=h: rotate_groups(x, h).to(torch.bfloat16), repeats)
        xb, hb = x.to(torch.bfloat16), hadamard(128, torch.bfloat16)
        b16 = _ms(lambda xb=xb, hb=hb: rotate_groups(xb, hb), repeats)
        lines.append(f"{rows} x 640, groups of 128: float32 {f32 * 1000:.0f} us, "
                     f"bf16 {b16 * 1000:.0f} us")  # fmt: skip
    return lines


def int8_rows(repeats: int) -> list[str]:
    """int8 weights: torch's packed op vs dequantize + matmul per batch size
    (engine/weights/quantization.py INT8_PACKED_MAX_ROWS), bf16, K 640, N 1536."""
    q = torch.randint(-127, 128, (1536, 640), dtype=torch.int8)
    s = torch.rand(1536) / 100
    lines = []
    for rows in (8, 32, 64, 128):
        x = torch.randn(rows, 640).to(torch.bfloat16)
        packed = _ms(lambda x=x: torch._weight_int8pack_mm(x, q, s.to(torch.bfloat16)), repeats)
        deq = _ms(lambda x=x: x @ (q.to(torch.bfloat16) * s.to(torch.bfloat16)[:, None]).T,
                  repeats)  # fmt: skip
        lines.append(f"{rows} rows: packed {packed:.3f} ms, dequantize + matmul {deq:.3f} ms")
    return lines


def packing(repeats: int) -> list[str]:
    """F.linear vs oneDNN's pre-packed weight (engine/models/packing.py), float32 and bf16."""
    import torch.nn.functional as F

    from loraplex.engine.models.packing import _pack, _packed_linear

    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(4096, 640).to(dtype)
        try:
            p = _pack(w)
        except RuntimeError as e:  # no oneDNN path for this dtype on this CPU
            lines.append(f"{dtype}: cannot pack here ({e})")
            continue
        for rows in (1, 32):
            x = torch.randn(rows, 640).to(dtype)
            plain = _ms(lambda x=x, w=w: F.linear(x, w), repeats)
            fast = _ms(lambda x=x, p=p: _packed_linear(x, p, None), repeats)
            lines.append(f"{str(dtype).removeprefix('torch.')} [{rows}, 640] x [640, 4096]: "
                         f"F.linear {plain:.3f} ms, packed {fast:.3f} ms")  # fmt: skip
    return lines


def half_matmul(repeats: int) -> list[str]:
    """A bf16 matmul against the same in float32 (engine/config.py cpu_has_native_half)."""
    a, b = torch.randn(32, 2048), torch.randn(2048, 2048)
    f32 = _ms(lambda: a @ b, repeats)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    b16 = _ms(lambda: ab @ bb, repeats)
    return [
        f"[32, 2048] x [2048, 2048]: float32 {f32:.2f} ms, bf16 {b16:.2f} ms (x{b16 / f32:.1f})"
    ]


def key_hash(repeats: int) -> list[str]:
    """SHA-256 of an API key vs a deliberately slow KDF (platform/security.py): stdlib scrypt
    at n=2**14, r=8, p=1, the cost its docs suggest for interactive logins."""
    import hashlib

    secret = b"lpx_" + bytes(32)
    fast = _ms(lambda: hashlib.sha256(secret).digest(), repeats)
    slow = _ms(lambda: hashlib.scrypt(secret, salt=b"s" * 16, n=2**14, r=8, p=1), repeats)
    return [f"sha256 {fast * 1000:.1f} us, scrypt {slow:.1f} ms"]


def expand(repeats: int) -> list[str]:
    """The LoRA expand of a decode step at batch 64 with 32 adapters (two rows per slot) on
    `python -m benchmarks.step`'s skinny 32-layer model, in torch's forms: each layer's four
    B stacks as the engine holds them ([slots, width, out]; the fused q|k|v and gate|up keep
    each slice's rows in the whole output's columns, zeros elsewhere), 32 layers of them so
    that they come from memory as in a step. `baddbmm_` is what `lora_apply` runs; the sum
    of the same bytes is what reading them costs at this core's bandwidth; the last form is
    inductor's generated C++ for the mul + sum (built on first use)."""
    import torch.nn.functional as F

    slots, rows, layers = 32, 2, 32
    shapes = ((48, 384), (16, 64), (32, 256), (16, 64))  # qkv, o, gate_up, down: width, out
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)

        def rand(*shape, gen=gen, dtype=dtype):
            return torch.randn(*shape, generator=gen).to(dtype)

        stacks = [[rand(slots, w, o) for w, o in shapes] for _ in range(layers)]
        xs = [[rand(slots, rows, w) for w, _ in shapes] for _ in range(layers)]
        ys = [[rand(slots, rows, o) for _, o in shapes] for _ in range(layers)]
        index = {w: torch.arange(slots * w).view(slots, 1, w).expand(slots, rows, w)
                 .reshape(-1, w) for w, _ in shapes}  # fmt: skip

        def over_step(form, stacks=stacks, xs=xs, ys=ys):
            def run():
                for bs, ts, outs in zip(stacks, xs, ys, strict=True):
                    for b, t, y in zip(bs, ts, outs, strict=True):
                        form(y, t, b)

            return run

        def bag(y, t, b, index=index):
            s, w, o = b.shape
            y.view(-1, o).add_(F.embedding_bag(index[w], b.view(-1, o), mode="sum",
                                               per_sample_weights=t.reshape(-1, w)))  # fmt: skip

        forms = {
            "baddbmm_ (the engine's)": lambda y, t, b: y.baddbmm_(t, b),
            "bmm + add_": lambda y, t, b: y.add_(torch.bmm(t, b)),
            "mul + sum": lambda y, t, b: y.add_((t.unsqueeze(-1) * b.unsqueeze(1)).sum(2)),
            "embedding_bag": bag,
        }

        def mul_sum(y, t, b):
            y += (t.unsqueeze(-1) * b.unsqueeze(1)).sum(2)

        try:  # inductor's C++ for the same product: needs a C++ compiler, seconds to build
            compiled = torch.compile(mul_sum, dynamic=True)
            over_step(compiled)()
            forms["mul + sum, torch.compile"] = compiled
        except Exception as e:  # noqa: BLE001 - reported, the other forms still run
            lines.append(f"torch.compile failed: {type(e).__name__}: {e}"[:200])
        whole = torch.cat([b.reshape(-1) for bs in stacks for b in bs])
        read = _ms(whole.sum, repeats)
        name = str(dtype).removeprefix("torch.")
        lines.append(f"{name}: B stacks {whole.nbytes / 1e6:.0f} MB a step, read by torch.sum "
                     f"in {read:.2f} ms ({whole.nbytes / read / 1e6:.1f} GB/s)")  # fmt: skip
        for label, form in forms.items():
            ms = _ms(over_step(form), repeats)
            lines.append(f"  {label:24s} {ms:6.2f} ms a step ({read / ms:.0%} of the read rate)")
    return lines


MEASURES = {
    "argmax": argmax,
    "topk": topk,
    "xgrammar": xgrammar,
    "upcast": upcast,
    "gather": gather,
    "gqa": gqa,
    "rotation": rotation,
    "int8-rows": int8_rows,
    "packing": packing,
    "half-matmul": half_matmul,
    "key-hash": key_hash,
    "expand": expand,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=[*MEASURES, "all"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for name in MEASURES if args.what == "all" else [args.what]:
        print(f"== {name}")
        for line in MEASURES[name](args.repeats):
            print(line)


if __name__ == "__main__":
    main()
