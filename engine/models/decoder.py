"""One decoder-only transformer for every supported family (dense and mixture of experts).

Module names follow the Hugging Face checkpoints (fused projections aside) so weights load by
name. The forward pass runs over a flat batch of new tokens from many sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.forward_context import ForwardContext
from loraplex.engine.models.layers import MLP, Attention, RMSNorm
from loraplex.engine.models.moe import SparseMoE
from loraplex.engine.models.spec import ModelSpec
from loraplex.kernels.dispatch import UsesBackend


class DecoderLayer(UsesBackend, nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        eps, g = spec.rms_norm_eps, spec.gemma
        self.self_attn = Attention(spec, layer)
        self.mlp = SparseMoE(spec) if spec.is_sparse(layer) else MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, g)
        if g:  # Gemma normalises both sides of each sublayer
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, g)
        self.gemma = g

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """The layer's output hidden states (x is not changed)."""
        out, residual = self.forward_residual(x.clone(), None, positions, ctx, first=True)
        return residual.add_(out)

    def forward_residual(self, out: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, ctx: ForwardContext,
                         first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The pre-norm layer on a residual stream: the previous sublayer's `out` is added to
        `residual` (in place) as this layer's first norm reads it (`add_rms_norm`: one fused
        op per seam); returns this layer's last sublayer output and the residual, which the
        next layer (or the final norm) adds. `first`: residual is None and out the
        embeddings, which become the residual."""
        attn_norm = self.input_layernorm
        mlp_norm = self.pre_feedforward_layernorm if self.gemma else self.post_attention_layernorm
        h, residual = self._norm(out, None if first else residual, attn_norm)
        a = self.self_attn(h, positions, ctx)
        if self.gemma:
            a = self.post_attention_layernorm(a)
        h, residual = self._norm(a, residual, mlp_norm)
        m = self.mlp(h, ctx.lora)
        if self.gemma:
            m = self.post_feedforward_layernorm(m)
        return m, residual

    def _norm(self, x, residual, norm: RMSNorm):
        return self.backend.add_rms_norm(x, residual, norm.weight, norm.eps, norm.gemma,
                                         norm.eps_tensor)  # fmt: skip


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma)


class DecoderLM(UsesBackend, nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, activations and KV cache (the embedding's: it always
        stays a plain float tensor, whatever form the lm_head and linears take)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:
            # Gemma scales in the weights' dtype, rounding included.
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        out, residual = x, None
        for i, layer in enumerate(self.model.layers):
            out, residual = layer.forward_residual(out, residual, positions, ctx, first=i == 0)
        norm = self.model.norm
        if residual is None:  # no layers
            return norm(out)
        return self.backend.add_rms_norm(out, residual, norm.weight, norm.eps, norm.gemma,
                                         norm.eps_tensor)[0]  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden] -> logits [rows, vocab]; only rows that sample.

        In the weights' dtype (float32 with a final softcap): the sampler upcasts only what
        needs float32, and a greedy argmax is exact in any dtype. Upcasting every row would
        copy the whole [rows, vocab] block each step, a large part of a decode step at a
        262k vocabulary (docs/benchmarks.md, "Measurements behind choices in the code").
        """
        logits = self.lm_head(hidden)
        if self.spec.final_softcap:
            cap = self.spec.final_softcap
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def build_buffers(self, device: torch.device, max_len: int) -> None:
        shared: dict = {}
        for layer in self.model.layers:
            layer.self_attn.rotary.build(device, max_len, shared)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.eps_tensor = torch.full((1, 1), m.eps, dtype=torch.float32, device=device)
