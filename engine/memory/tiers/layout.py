"""A KV block as bytes: every cached tensor's rows of one block, in a fixed order, and back.

    payload = for each layer, for k_cache, v_cache (and k_scale, v_scale with an int8 cache):
              that tensor's [block_size, kv_heads, head_dim] (or [block_size, kv_heads]) rows

The layout (each segment's dtype and per-block shape, and the block size) is part of every
store key (engine/memory/tiers/keys.py), so an engine only ever reads blocks of its own layout.
Both directions run on the engine thread between steps: a gather right after the step that
computed the blocks (before any later step can reuse them), a scatter right before the step
that attends to them; each is one indexed copy per tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplex.engine.memory.swap import KV_TENSORS


class KVLayout:
    def __init__(self, attentions: list, block_size: int):
        self.attentions = attentions
        self.block_size = block_size
        self.segments: list[tuple[int, str, torch.dtype, tuple[int, ...], int]] = []
        for i, attn in enumerate(attentions):
            for name in KV_TENSORS:
                t = getattr(attn, name, None)
                if t is not None:
                    shape = tuple(t.shape[1:])
                    nbytes = int(np.prod(shape)) * t.element_size()
                    self.segments.append((i, name, t.dtype, shape, nbytes))
        self.block_bytes = sum(s[-1] for s in self.segments)
        self.device = attentions[0].k_cache.device if attentions else torch.device("cpu")

    def describe(self) -> list:
        """What the key must cover: block size, and each segment's dtype and shape."""
        return [self.block_size] + [[i, n, str(d), list(s)] for i, n, d, s, _ in self.segments]

    @torch.inference_mode()
    def gather(self, block_ids: list[int]) -> list[bytes]:
        """The payloads of device blocks `block_ids`."""
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, device=self.device)
        n = len(block_ids)
        parts = [
            getattr(self.attentions[i], name)[idx].reshape(n, -1).view(torch.uint8)
            for i, name, *_ in self.segments
        ]
        rows = torch.cat(parts, dim=1).cpu().numpy()
        return [r.tobytes() for r in rows]

    @torch.inference_mode()
    def scatter(self, pairs: list[tuple[bytes, int]]) -> None:
        """Write payloads into device blocks: (payload, block id) pairs."""
        if not pairs:
            return
        n = len(pairs)
        buf = bytearray(b"".join(p for p, _ in pairs))  # writable: torch.from_numpy wants it
        rows = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8).reshape(n, self.block_bytes))
        rows = rows.to(self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        off = 0
        for i, name, dtype, shape, nbytes in self.segments:
            chunk = rows[:, off : off + nbytes].contiguous().view(dtype).reshape(n, *shape)
            getattr(self.attentions[i], name)[dst] = chunk
            off += nbytes
