"""Kernel tests run compiled on CUDA, else under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any `@triton.jit` runs; the kernel modules are imported
only by these tests (the engine imports them lazily on CUDA tensors), so setting it here, at
collection time, is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.float16: dict(atol=2e-2, rtol=2e-2),
        torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
    }[dtype]
