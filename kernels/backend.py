"""One engine's kernels: which implementation runs each op and how, as an object.

An engine's model runner owns a `KernelBackend` and binds it to the model's modules, so two
engines in one process (a test's reference and its subject, a fleet benchmark's replicas)
each run their own choice, the engine's `kernel_mode` option (engine/options.py):

    auto       Triton on CUDA tensors, the CPU backend (`cpu.py`, batched torch) elsewhere
    reference  the torch reference (`reference.py`, the kernels' oracle) everywhere: slow,
               written for clarity; for checking the fast paths
    triton     the Triton kernels everywhere (on CPU only under TRITON_INTERPRET=1)

and on the CPU the attention form ("sdpa" or "matmul", timed at the runner's start). Nothing
about it lives at module level.

The ops that share work across the layers of a step (attention's decode groups and tile
lists, LoRA's segment groups and tiles) take a plan (typed: kernels/plans.py) built once per
step by the step planner (`plan_attention`, `plan_lora`; engine/step/step_plan.py) before the
forward; a direct call without one (tools, tests) plans for itself.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from loraplex.kernels import cpu, cpu_moe, cpu_plan, fused_cpu, fused_reference, reference
from loraplex.kernels.plans import AttentionPlan, LoRAPlan

MODES = ("auto", "reference", "triton")


@functools.cache
def _triton(name: str) -> ModuleType:
    # Imported on first use: @triton.jit decides at decoration time whether it builds an
    # interpreted or a compiled kernel (TRITON_INTERPRET), so not at import.
    return importlib.import_module(f"loraplex.kernels.{name}")


@dataclass(frozen=True)
class KernelBackend:
    mode: str = "auto"  # auto: Triton on CUDA tensors, the CPU backend elsewhere
    cpu_attention: str = "sdpa"  # the CPU backend's attention form: sdpa | matmul

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"kernel mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.cpu_attention not in cpu.ATTENTION_IMPLS:
            raise ValueError(
                f"CPU attention must be one of {cpu.ATTENTION_IMPLS}, not {self.cpu_attention!r}"
            )

    def which(self, t: torch.Tensor | torch.device) -> str:
        """ "triton", "cpu" or "reference" for an op on tensor (or device) `t`."""
        cuda = (t if isinstance(t, torch.device) else t.device).type == "cuda"
        if self.mode == "triton" or (self.mode == "auto" and cuda):
            return "triton"
        return "reference" if self.mode == "reference" else "cpu"

    # -------------------------------------------------------------- plans (once per step)
    def plan_attention(self, block_tables: torch.Tensor, query_start_loc: Sequence[int],
                       seq_lens: Sequence[int], block_size: int, num_heads: int,
                       num_kv_heads: int, windows: Sequence[int | None] = (None,),
                       dtype: torch.dtype = torch.float32) -> AttentionPlan:  # fmt: skip
        """What every layer's attention of one step shares (None: the reference plans
        nothing); `windows`: the sliding windows the model's layers use; `dtype`: the
        queries'."""
        which = self.which(block_tables)
        if which == "cpu":
            return cpu_plan.plan_attention(block_tables, query_start_loc, seq_lens, block_size,
                                      windows, (num_kv_heads,), dtype, num_heads)  # fmt: skip
        if which == "triton":
            return _triton("paged_attention").plan_attention(
                query_start_loc, seq_lens, num_heads, num_kv_heads, block_tables.device
            )
        return None

    def plan_lora(self, segments: Sequence[tuple[int, int, int]], widths: Sequence[int],
                  device: torch.device) -> LoRAPlan:  # fmt: skip
        """lora_apply's plan for one step's segments and one set of slot widths (None: the
        reference plans nothing, and Triton nothing where no row has LoRA work)."""
        which = self.which(torch.device(device))
        if which == "cpu":
            return cpu_plan.plan_lora(segments, widths, device)
        if which == "triton":
            if not any(slot >= 0 and widths[slot] for _, _, slot in segments):
                return None
            return _triton("sgmv").build_meta(segments, widths, device)
        return None

    # -------------------------------------------------------------------------- ops
    def write_kv_cache(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
        which = self.which(k)
        mod = _triton("kv_cache") if which == "triton" else (cpu if which == "cpu" else reference)
        mod.write_kv_cache(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def paged_attention(self, out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                        scale, sliding_window=None, softcap=None, k_scale=None, v_scale=None,
                        *, plan: AttentionPlan = None, sinks=None) -> torch.Tensor:  # fmt: skip
        """Attention of q's rows over the paged caches, into `out` [T, H, d], which it returns;
        `out` None: into a tensor of the kernel's choosing (the CPU's one-token decode returns
        its kernel's own output rather than copying it), returned."""
        which = self.which(q)
        if out is None and which != "cpu":
            out = q.new_empty(q.shape)
        args = (out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                sliding_window, softcap, k_scale, v_scale)  # fmt: skip
        if which == "cpu":
            return cpu.paged_attention(*args, plan=plan, sinks=sinks, impl=self.cpu_attention)
        if which == "triton":
            _triton("paged_attention").paged_attention(*args, plan=plan, sinks=sinks)
        else:
            reference.paged_attention(*args, sinks=sinks)
        return out

    def lora_apply(self, y, x, lora_a, lora_b, segments, widths, *, plan: LoRAPlan = None,
                   lora_a_t=None, slot_views=None) -> None:  # fmt: skip
        """y += each segment's LoRA delta. `lora_a_t`: lora_a.mT made once by the caller (the
        CPU's batched shrink reads it); `slot_views`: lora_a_t's and lora_b's views slot by
        slot, made once by the caller (the CPU's one-adapter groups read them)."""
        which = self.which(x)
        if which == "cpu":
            cpu.lora_apply(y, x, lora_a, lora_b, segments, widths, plan=plan, lora_a_t=lora_a_t,
                           slot_views=slot_views)  # fmt: skip
        elif which == "triton":
            _triton("sgmv").lora_apply(y, x, lora_a, lora_b, segments, widths, plan=plan)
        else:
            reference.lora_apply(y, x, lora_a, lora_b, segments, widths)

    def dora_apply(self, y, factor, shift, slots, rows=None) -> None:
        """DoRA's per-row factor after the LoRA delta (reference.dora_apply), for every
        backend alike: an elementwise epilogue on the layer's output, after the SGMV kernels
        on Triton and the batched matmuls on the CPU, and graph-safe for the static path."""
        reference.dora_apply(y, factor, shift, slots, rows)

    def decode_attention_static(self, out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                sliding_window=None, softcap=None, k_scale=None, v_scale=None,
                                *, sinks=None) -> None:  # fmt: skip
        """A decode step from fixed-shape tensors only (graph-ready; plain torch on any
        device): see cpu.decode_attention_static."""
        impl = self.cpu_attention if self.which(q) == "cpu" else "sdpa"
        cpu.decode_attention_static(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                    sliding_window, softcap, k_scale, v_scale, sinks=sinks,
                                    impl=impl)  # fmt: skip

    def lora_apply_static(self, y, x, lora_a, lora_b, row_slots) -> None:
        cpu.lora_apply_static(y, x, lora_a, lora_b, row_slots)

    # ---------------------------------------------- fused per-layer ops (fused_reference.py)
    def _fused(self, t: torch.Tensor) -> ModuleType:
        which = self.which(t)
        if which == "triton":
            return _triton("fused")
        return fused_cpu if which == "cpu" else fused_reference

    def add_rms_norm(self, x, residual, weight, eps: float, gemma: bool, eps_tensor=None):
        """residual += x, then RMSNorm of it: (normed, residual); residual None: (norm(x), x).
        `eps_tensor`: eps as a float32 [1, 1] tensor, the CPU form's fewer-op path."""
        mod = self._fused(x)
        if mod is fused_cpu and eps_tensor is not None:
            return mod.add_rms_norm(x, residual, weight, eps_tensor, gemma)
        return mod.add_rms_norm(x, residual, weight, eps, gemma)

    def rope_and_write_kv(self, q, k, v, rows, rotary_dim: int, k_cache, v_cache, slot_mapping):
        """RoPE of q and k in place from the step's `rope_rows`, then k, v into the caches."""
        return self._fused(q).rope_and_write_kv(q, k, v, rows, None, rotary_dim, k_cache,
                                                v_cache, slot_mapping)  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, limit: float | None = None, alpha: float = 1.702):
        return self._fused(gate_up).silu_mul(gate_up, limit, alpha)

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        which = self.which(x)
        mod = _triton("moe_triton") if which == "triton" else (cpu if which == "cpu" else reference)
        return mod.grouped_mm(x, w, offs)

    def grouped_lora_rows(self, x, a_t, b, group, width: int) -> torch.Tensor:
        """Expert LoRA with each row through its own group's A and B, read in place: the CPU
        backend's per-row form (cpu_moe.grouped_lora_rows), which a caller takes where
        `which(x)` is "cpu" and the rows are about one per group (a decode step)."""
        return cpu_moe.grouped_lora_rows(x, a_t, b, group, width)

    def dequant_weight(self, qweight, scales, zeros=None, group_size: int = 128):
        """A weight-only int4 / int8 weight with its Triton launches planned once per batch
        size (dequant_matmul.DequantWeight: a few µs of Python per call where int4_matmul
        takes tens), for a module to keep beside its weight; None off CUDA."""
        if self.which(qweight) != "triton" or qweight.device.type != "cuda":
            return None
        return _triton("dequant_matmul").DequantWeight(qweight, scales, zeros, group_size)

    def int8_matmul(self, *args, **kwargs):
        return self._matmul("int8_matmul", args, kwargs)

    def int4_matmul(self, *args, **kwargs):
        return self._matmul("int4_matmul", args, kwargs)

    def _matmul(self, name: str, args: tuple, kwargs: dict):
        which = self.which(args[0])
        mod = (_triton("dequant_matmul") if which == "triton"
               else (cpu if which == "cpu" else reference))  # fmt: skip
        return getattr(mod, name)(*args, **kwargs)


def bind(model: torch.nn.Module, backend: KernelBackend) -> None:
    """Give every module of `model` that runs kernels (it has a `backend` attribute) this one."""
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
