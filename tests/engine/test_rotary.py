"""RoPE rows looked up once per forward pass and shared by the layers that use one table."""

from __future__ import annotations

import torch

from loraplex.engine.models.layers import Rotary
from loraplex.engine.models.spec import RopeSpec


def _rotaries(n: int, rope: RopeSpec, head_dim: int = 16) -> list[Rotary]:
    shared: dict = {}
    rotaries = [Rotary(rope, head_dim) for _ in range(n)]
    for r in rotaries:
        r.build(torch.device("cpu"), 64, shared)
    return rotaries


def test_memo_gives_bitwise_the_same_rotation_and_one_entry_per_table_and_step():
    local, glob = _rotaries(2, RopeSpec(theta=10_000.0)), _rotaries(1, RopeSpec(theta=1e6))
    gen = torch.Generator().manual_seed(0)
    memo: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        positions = torch.tensor([3, 0, 17, 63, 5])
        for rot in (*local, *glob):
            for heads in (4, 1):  # q, then k
                x = torch.randn(5, heads, 16, generator=gen).to(dtype)
                assert torch.equal(rot(x, positions, memo), rot(x, positions))
        # The two layers of one RoPE share an entry; the other RoPE has its own.
        assert sum(1 for k in memo if k[-1] == dtype) == 2
    # Other positions (the next step, or a context reused by mistake) get their own rows.
    x = torch.randn(2, 4, 16, generator=gen)
    later = torch.tensor([40, 41])
    assert torch.equal(local[0](x, later, memo), local[0](x, later))
    # Position 0 leaves x as it is.
    assert torch.equal(local[0](x[:1], torch.tensor([0]), memo), x[:1])
