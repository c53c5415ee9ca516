"""Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss), with LoRA on the experts.

A token's router picks `top_k` experts; each (token, expert) pair is one row of work. The rows
are sorted by expert once per layer, so every expert's rows go through one matmul: a grouped
matmul over all experts (the backend's `grouped_mm`: torch's grouped GEMM on the CPU, a Triton
grouped GEMM over sorted row blocks on CUDA), never a loop over tokens or experts in Python.

Expert LoRA takes the same path. Each adapter slot holds, per expert, the A and B of the
expert's gate|up and down projections (`lora_gate_up_a` [slots, experts, width, hidden], ...).
A row with adapter slot s routed to expert e belongs to the "virtual expert" s * experts + e,
so one grouped matmul over slots x experts applies every row's own adapter delta (shrink, then
expand) without building any weight per token; rows without an expert adapter skip it. On the
CPU, a decode step (about one row per virtual expert) skips the grouping altogether: each row
reads its own A and B rows in place (the backend's `grouped_lora_rows`), which is what a
decode step with expert adapters costs beyond the base: the bytes of those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.forward_context import LoRABatch
from loraplex.engine.models.layers import MLP, LoRALinear
from loraplex.engine.models.spec import ModelSpec
from loraplex.kernels.dispatch import UsesBackend

# The per-row form of expert LoRA (`Experts._virtual`) reads a virtual expert's A and B once per
# row; the grouped form once per virtual expert, but through a sort, a gather of the used
# groups' weights and one matmul call per group. Per row while the rows are at most this many
# times the virtual experts they use.
_ROWS_PER_VIRTUAL = 2


@dataclass
class _Virtual:
    """A layer's expert-LoRA rows: `rows` (pair indices, in the pairs' expert order; None: all
    pairs), `v` each one's virtual expert; for the grouped form also `order` (the rows by
    virtual expert) and `offs` (each virtual expert's cumulative row end)."""

    rows: torch.Tensor | None
    v: torch.Tensor
    order: torch.Tensor | None = None
    offs: torch.Tensor | None = None


def _rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """t [..., width, in] as a transposed view of [..., in, width] memory (t's values)."""
    if t is None or t.transpose(-1, -2).is_contiguous():
        return t
    out = torch.empty(*t.shape[:-2], t.shape[-1], t.shape[-2], dtype=t.dtype, device=t.device)
    return out.transpose(-1, -2).copy_(t)


class Experts(UsesBackend, nn.Module):
    """Every expert's gate|up [experts, 2 * inter, hidden] and down [experts, hidden, inter]
    weights (transformers 5's fused layout), and the adapter slots' expert LoRA stacks, which
    the adapter manager allocates on the first expert adapter it installs."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.num_experts, self.hidden, self.inter = e, h, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        if spec.expert_bias:  # gpt-oss
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.limit, self.alpha = spec.swiglu_limit, spec.swiglu_alpha
        # [slots, experts, width, in] and [slots, experts, width, out]; width = 2 * max rank
        # for gate|up (the two slices' ranks stacked), max rank for down
        self.lora_gate_up_a: torch.Tensor | None = None
        self.lora_gate_up_b: torch.Tensor | None = None
        self.lora_down_a: torch.Tensor | None = None
        self.lora_down_b: torch.Tensor | None = None
        self.lora_widths: list[int] = []  # per slot: its expert LoRA rows (0: none)
        self.lora_gate_up_widths: list[int] = []  # per slot: rows used in the gate|up stacks
        self.lora_down_widths: list[int] = []

    # The A stacks are kept as transposed views of [slots, experts, in, width] memory (the
    # adapter manager allocates [slots, experts, width, in] and writes slots through the view):
    # the CPU's per-row form reads a row's A^T in place as `in` rows of its width.
    @property
    def lora_gate_up_a(self) -> torch.Tensor | None:
        return self._lora_gate_up_a

    @lora_gate_up_a.setter
    def lora_gate_up_a(self, t: torch.Tensor | None) -> None:
        self._lora_gate_up_a = _rows_of(t)

    @property
    def lora_down_a(self) -> torch.Tensor | None:
        return self._lora_down_a

    @lora_down_a.setter
    def lora_down_a(self, t: torch.Tensor | None) -> None:
        self._lora_down_a = _rows_of(t)

    def base_gate_up(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Quantized experts (engine/weights/quantization.py) replace the two base products."""
        return self.backend.grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs)

    def base_down(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.backend.grouped_mm(x, self.down_proj.transpose(1, 2), offs)

    def _lora(self, y: torch.Tensor, x: torch.Tensor, virt: _Virtual | None,
              a: torch.Tensor | None, b: torch.Tensor | None,
              widths: list[int]) -> None:  # fmt: skip
        """y[rows] += B_v A_v x[rows] for each row's virtual expert v (see the module doc).
        Only the widest slot's rows of the stacks are read (past a slot's own width they are
        zeros, which add nothing): no stack is copied."""
        width = max(widths, default=0)
        if virt is None or a is None or width == 0:
            return
        s, e = a.shape[:2]
        if virt.order is None:  # the per-row form (see _virtual)
            xr = x if virt.rows is None else x[virt.rows]
            a_t = a.transpose(2, 3).reshape(s * e, a.shape[3], a.shape[2])  # a view (_rows_of)
            b = b.view(s * e, *b.shape[2:])
            delta = self.backend.grouped_lora_rows(xr, a_t, b, virt.v, width)
            if virt.rows is None:
                y.add_(delta.to(y.dtype))
            else:
                y.index_add_(0, virt.rows, delta.to(y.dtype))
            return
        rows = virt.rows[virt.order]
        xa = x[rows]
        # [slots, experts, width, features] -> [slots * experts, ...]: a view (slots and
        # experts stay one stride apart)
        wa = a[:, :, :width].reshape(s * e, width, a.shape[-1]).transpose(1, 2)
        wb = b[:, :, :width].reshape(s * e, width, b.shape[-1])
        delta = self.backend.grouped_mm(self.backend.grouped_mm(xa, wa, virt.offs), wb, virt.offs)
        y.index_add_(0, rows, delta.to(y.dtype))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                lora: LoRABatch | None) -> torch.Tensor:  # fmt: skip
        """x [tokens, hidden], experts/weights [tokens, top_k] -> [tokens, hidden]; `lora`
        (None: no adapter in the batch) gives each token's slot."""
        tokens, top_k = experts.shape
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs by expert; a token's in expert order
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[token]
        sorted_experts = flat[order]
        virt = self._virtual(sorted_experts, lora, token) if lora is not None else None
        h = self.base_gate_up(xs, offs)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[sorted_experts]
        self._lora(h, xs, virt, self.lora_gate_up_a, self.lora_gate_up_b,
                   self.lora_gate_up_widths)  # fmt: skip
        a = self.activation(*h.chunk(2, dim=-1))
        y = self.base_down(a, offs)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[sorted_experts]
        self._lora(y, a, virt, self.lora_down_a, self.lora_down_b, self.lora_down_widths)
        y = y * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        # In expert order for every token: the sum runs as transformers' loop over experts.
        return out.index_add_(0, token, y)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        # gpt-oss: gate clamped above, up both ways, then (up + 1) * gate * sigmoid(alpha gate)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _virtual(self, expert: torch.Tensor, lora: LoRABatch, token: torch.Tensor):
        """For pairs sorted by expert: which have an expert adapter, and each one's virtual
        expert (slot * experts + expert). On the CPU, while the pairs are about one per
        virtual expert (a decode step, where each row's adapter is its own), every pair reads
        its own A and B in place (the backend's `grouped_lora_rows`): no sort, no grouped call. Else
        they are sorted by virtual expert for two grouped matmuls, which read each virtual
        expert's A and B once for all its rows (a long prompt's many rows per expert)."""
        if self.lora_gate_up_a is None or not any(self.lora_widths):
            return None
        # the step planner's (engine/step/step_plan.py): each row's slot, and which slots
        # hold an expert adapter in stacks of these widths
        has = lora.expert_slots[tuple(self.lora_widths)]
        slot = lora.row_slots[token]
        on = (slot >= 0) & has[slot.clamp(min=0)]
        n = int(on.sum())
        if n == 0:
            return None
        rows = None if n == on.shape[0] else torch.nonzero(on).flatten()
        v = slot * self.num_experts + expert
        if rows is not None:
            v = v[rows]
        n_virtual = len(self.lora_widths) * self.num_experts
        counts = torch.bincount(v, minlength=n_virtual)
        per_row = (
            self.backend.which(expert) == "cpu"
            and self.lora_gate_up_a.transpose(2, 3).is_contiguous()
            and self.lora_down_a.transpose(2, 3).is_contiguous()
            and self.lora_gate_up_b.is_contiguous()
            and self.lora_down_b.is_contiguous()
            and n <= _ROWS_PER_VIRTUAL * int(torch.count_nonzero(counts))
        )
        if per_row:
            return _Virtual(rows, v)
        if rows is None:
            rows = torch.arange(n, device=expert.device)
        order = torch.argsort(v, stable=True)
        return _Virtual(rows, v, order, counts.cumsum(0).to(torch.int32))


class SparseMoE(nn.Module):
    """The `mlp` of a routed layer: the router (`gate`; gpt-oss: `router`, a LoRA target like
    any linear), `experts`, and Qwen2-MoE's `shared_expert` with its `shared_expert_gate`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k, self.norm_topk_prob = spec.top_k, spec.norm_topk_prob
        self.softmax_after_topk = spec.softmax_after_topk
        self.router_name = spec.router_name
        router = LoRALinear(spec.hidden_size, [spec.num_experts], bias=spec.router_bias)
        setattr(self, spec.router_name, router)
        self.experts = Experts(spec)
        self.shared_expert = None
        if spec.shared_expert_size:
            self.shared_expert = MLP(spec, spec.shared_expert_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, lora: LoRABatch | None):
        """As transformers: softmax in float32 over all experts, top-k, optionally
        renormalised, back to the activations' dtype; gpt-oss: top-k logits, then their
        softmax in the logits' dtype."""
        logits = getattr(self, self.router_name)(x, lora)
        if self.softmax_after_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        weights, experts = self.route(x, lora)
        out = self.experts(x, experts, weights, lora)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, lora)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out
