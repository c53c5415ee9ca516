"""Attention sinks (gpt-oss: a learned logit per head that joins the softmax and multiplies no
value): the reference against transformers' own eager attention, the CPU backend's forms and
the Triton kernel (under the interpreter on the CPU) against the reference, on steps mixing
prefill chunks over cached prefixes with decodes, with sliding windows, GQA/MQA, split-KV
decode and int8 KV caches."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from loraplex.kernels import cpu, dispatch, paged_attention, reference
from tests.kernels.conftest import DEVICE, tolerance
from tests.kernels.test_cpu_backend import STEPS
from tests.kernels.test_kv_int8 import _quantized
from tests.kernels.test_paged_attention import _batch

HEADS = [(8, 2, 64), (4, 1, 32)]  # GQA, MQA


def _sinks(num_heads: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Sink logits in the scores' range, so each takes a visible share; head 0's is -inf (no
    sink at all: the plain softmax)."""
    sinks = torch.randn(num_heads, generator=gen) * 2.0
    sinks[0] = float("-inf")
    return sinks.to(device)


def _step(gen, dtype, heads, contexts, news, int8=False, device="cpu"):
    nan_caches, clean, q, tables, qsl, lens = _batch(device, gen, dtype, heads, 8, contexts,
                                                     news)  # fmt: skip
    caches, scales = (_quantized(clean)[:2], _quantized(clean)[2:]) if int8 else (nan_caches, ())
    return clean, caches, scales, q, tables, qsl, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("window", [None, 1, 6])
def test_reference_matches_transformers_gpt_oss_eager_attention(gen, dtype, heads, window):
    """Each sequence's queries through transformers' gpt-oss eager attention (the sink
    concatenated to the masked scores, softmax, sink column dropped) with transformers' own
    causal / sliding-window mask: the same as the paged reference."""
    h, kvh, d = heads
    clean, _, _, q, tables, qsl, lens = _step(gen, dtype, heads, [0, 13, 5], [11, 4, 1])
    sinks = _sinks(h, gen)
    scale = d**-0.5
    got = torch.zeros_like(q)
    reference.paged_attention(got, q, *clean, tables, qsl, lens, scale, window, sinks=sinks)
    for i, length in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        nb = -(-length // 8)
        k, v = (reference.gather_kv(c, tables[i, :nb], length) for c in clean)  # [L, KVH, d]
        q_idx = torch.arange(length - (e - s), length).view(-1, 1)
        kv_idx = torch.arange(length).view(1, -1)
        fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
        allowed = fn(0, 0, q_idx, kv_idx)  # [n, L]
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)  # transformers' additive form
        module = SimpleNamespace(sinks=sinks.to(dtype), num_key_value_groups=h // kvh,
                                 training=False)  # fmt: skip
        want, _ = eager_attention_forward(
            module, q[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], mask[None, None], scale,
        )  # fmt: skip
        torch.testing.assert_close(got[s:e].float(), want[0].float(), **tolerance(dtype))


def test_sinks_only_scale_the_plain_softmax(gen):
    """With a sink s the output is the sink-free output times the share the keys keep,
    sigmoid(logsumexp(scores) - s): a -inf sink changes nothing, a huge one silences the
    head."""
    heads = (4, 2, 32)
    clean, _, _, q, tables, qsl, lens = _step(gen, torch.float32, heads, [9], [1])
    scale = heads[2] ** -0.5
    plain = torch.zeros_like(q)
    reference.paged_attention(plain, q, *clean, tables, qsl, lens, scale)
    k = reference.gather_kv(clean[0], tables[0, :2], lens[0])  # [L, KVH, d]
    scores = torch.einsum("hd,lhd->hl", q[0], k.repeat_interleave(2, 1)) * scale  # [H, L]
    sinks = torch.tensor([float("-inf"), -1.0, 0.5, 1e4])
    got = torch.zeros_like(q)
    reference.paged_attention(got, q, *clean, tables, qsl, lens, scale, sinks=sinks)
    keep = torch.sigmoid(scores.logsumexp(-1) - sinks)  # [H]
    torch.testing.assert_close(got[0], plain[0] * keep[:, None])
    assert got[0, 3].abs().max() < 1e-30


@pytest.mark.parametrize("impl", cpu.ATTENTION_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("window", "int8"), [(None, False), (8, False), (None, True)])
def test_cpu_backend_matches_the_reference(gen, impl, dtype, heads, step, window, int8):
    """Both CPU forms (sinks route "sdpa" to the matmul form) on decode batches, short
    multi-row queries and prefill chunks, several layers sharing the step's plan."""
    clean, caches, scales, q, tables, qsl, lens = _step(gen, dtype, heads, *STEPS[step], int8)
    caches = caches if int8 else clean  # its decode form reads whole blocks (NaN: no)
    sinks = _sinks(heads[0], gen)
    args = (*caches, tables, qsl, lens, heads[2] ** -0.5, window, None, *scales)
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *args, sinks=sinks)
    plan = cpu.plan_attention(tables, qsl, lens, caches[0].shape[1], [window], [heads[1]])
    plain = torch.full_like(q, float("nan"))
    cpu.paged_attention(plain, q, *args, plan=plan, impl=impl)  # a layer without sinks
    got = torch.full_like(q, float("nan"))
    cpu.paged_attention(got, q, *args, plan=plan, sinks=sinks, impl=impl)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    assert not torch.allclose(got.float(), plain.float(), **tolerance(dtype))


@pytest.mark.parametrize(
    ("dtype", "window", "int8"),
    [(torch.float32, None, False), (torch.float32, 6, False), (torch.float32, None, True),
     (torch.float16, None, False), (torch.float16, 6, False)],
)  # fmt: skip
def test_triton_kernel_matches_the_reference(device, gen, dtype, window, int8):
    """A fresh prompt, a chunk after a cached prefix and decode rows in one step."""
    heads = (8, 2, 64)
    clean, caches, scales, q, tables, qsl, lens = _step(
        gen, dtype, heads, [0, 37, 16, 5], [12, 9, 1, 1], int8, device
    )
    sinks = _sinks(heads[0], gen, device)
    args = (tables, qsl, lens, heads[2] ** -0.5, window, None)
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *(caches if int8 else clean), *args, *scales, sinks=sinks)
    got = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(got, q, *caches, *args, *scales, sinks=sinks)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


@pytest.mark.parametrize("window", [None, 8])
def test_triton_split_kv_counts_the_sink_once(device, gen, window):
    """Split-KV decode (some splits see no key): the sink joins the first split only."""
    heads = (4, 1, 32)
    clean, caches, _, q, tables, qsl, lens = _step(
        gen, torch.float32, heads, [0, 37, 70, 5], [1, 6, 1, 1], device=device
    )
    sinks = _sinks(heads[0], gen, device)
    args = (tables, qsl, lens, heads[2] ** -0.5, window, None)
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *clean, *args, sinks=sinks)
    got = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(got, q, *caches, *args, sinks=sinks, split_kv=3, block_n=16)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_dispatch_passes_sinks_on(gen):
    heads = (4, 2, 32)
    clean, _, _, q, tables, qsl, lens = _step(gen, torch.float32, heads, [3, 20], [1, 5])
    sinks = _sinks(heads[0], gen)
    args = (q, *clean, tables, qsl, lens, heads[2] ** -0.5)
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    reference.paged_attention(want, *args, sinks=sinks)
    dispatch.paged_attention(got, *args, sinks=sinks)
    torch.testing.assert_close(got, want)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels import paged_attention
fn = paged_attention._paged_attention_sinks_kernel
# gpt-oss: GQA 64 heads over 8, head_dim 64; decode (split or not) and prefill, window, int8.
for bq, window, split, int8 in ((4, True, 1, False), (4, False, 8, False), (8, True, 1, True)):
    cache = "i8" if int8 else "bf16"
    types = dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr=f"*{cache}",
                 v_cache_ptr=f"*{cache}", block_tables_ptr="*i64", tile_seq_ptr="*i32",
                 tile_row_ptr="*i32", q_end_ptr="*i32", seq_len_ptr="*i32", scale="fp32",
                 softcap="fp32", part_ptr="*fp32", ml_ptr="*fp32", k_scale_ptr="*fp16",
                 v_scale_ptr="*fp16", sinks_ptr="*fp32")
    consts = dict(PAGE=16, GROUP=8, HEAD_DIM=64, GP=8, BLOCK_Q=bq, BLOCK_N=64, BLOCK_D=64,
                  USE_SOFTCAP=False, USE_WINDOW=window, SPLIT_KV=split, KV_INT8=int8)
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    assert k.asm.get("cubin")
print("compiled")
"""


def test_sinks_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
@pytest.mark.gpu
def test_triton_bf16_on_gpu(gen):
    heads = (64, 8, 64)  # gpt-oss-20b's attention
    clean, caches, _, q, tables, qsl, lens = _step(
        gen, torch.bfloat16, heads, [0, 300, 40, 5], [64, 30, 1, 1], device="cuda"
    )
    sinks = _sinks(heads[0], gen, "cuda")
    for window in (None, 128):
        args = (tables, qsl, lens, heads[2] ** -0.5, window, None)
        want = torch.zeros_like(q)
        reference.paged_attention(want, q, *clean, *args, sinks=sinks)
        got = torch.full_like(q, float("nan"))
        paged_attention.paged_attention(got, q, *caches, *args, sinks=sinks)
        torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
