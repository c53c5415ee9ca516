"""RoPE rows looked up once per step (the step plan) and shared by the layers of one table."""

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


def test_planned_rows_give_bitwise_the_same_rotation_one_per_table():
    """The step plan looks each distinct table's rows up once (engine/step/step_plan.py); a layer
    given them rotates exactly as it would looking them up itself."""
    local, glob = _rotaries(2, RopeSpec(theta=10_000.0)), _rotaries(1, RopeSpec(theta=1e6))
    assert local[0].key == local[1].key != glob[0].key  # the two layers share one table
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        positions = torch.tensor([3, 0, 17, 63, 5])
        rope = {r.key: r.tables(positions, dtype) for r in (local[0], glob[0])}
        for rot in (*local, *glob):
            for heads in (4, 1):  # q, then k
                x = torch.randn(5, heads, 16, generator=gen).to(dtype)
                assert torch.equal(rot(x, positions, rope), rot(x, positions))
    # Position 0 leaves x as it is.
    x = torch.randn(2, 4, 16, generator=gen)
    assert torch.equal(local[0](x[:1], torch.tensor([0])), x[:1])
