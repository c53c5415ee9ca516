"""One decoder-only transformer for every supported family (dense and mixture of experts).

Module names follow the Hugging Face checkpoints (fused projections aside) so weights load by
name. The forward pass runs over a flat batch of new tokens from many sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.models.layers import MLP, Attention, ForwardContext, RMSNorm
from loraplex.engine.models.moe import SparseMoE
from loraplex.engine.models.spec import ModelSpec


class DecoderLayer(nn.Module):
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
        if self.gemma:
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), positions, ctx)
            )
            return x + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(x), ctx.lora)
            )
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx.lora)


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma)


class DecoderLM(nn.Module):
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
        for layer in self.model.layers:
            x = layer(x, positions, ctx)
        return self.model.norm(x)

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
