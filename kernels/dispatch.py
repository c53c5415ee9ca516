"""The process's default kernel mode, and the ops through a backend in that mode.

An engine runs its kernels through its own `KernelBackend` (kernels/backend.py), which takes
this module's mode when the engine starts; the functions here serve direct calls, tools and
tests. Each op keeps the reference's signature, semantics and docstring (see `reference.py`);
the implementation is chosen per call from the tensors' device and the mode:

    LORAPLEX_KERNELS=auto       (default) Triton on CUDA tensors, the CPU backend (`cpu.py`,
                                batched torch) elsewhere
    LORAPLEX_KERNELS=reference  the torch reference (the kernels' oracle) everywhere: slow,
                                written for clarity; for checking the fast paths
    LORAPLEX_KERNELS=triton     Triton everywhere (on CPU only under TRITON_INTERPRET=1)

Triton modules are imported on first use (kernels/backend.py says why).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from loraplex.kernels import reference
from loraplex.kernels.backend import MODES, KernelBackend

_mode = "auto"


def set_mode(mode: str) -> None:
    """Select the backend for every later call (auto | reference | triton)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"LORAPLEX_KERNELS must be one of {', '.join(MODES)}, not {mode!r}")
    _mode = mode


def get_mode() -> str:
    return _mode


def use_triton(t: torch.Tensor) -> bool:
    return _mode == "triton" or (_mode == "auto" and t.is_cuda)


set_mode(os.environ.get("LORAPLEX_KERNELS", "auto"))


def default_backend() -> KernelBackend:
    """A backend in the process's default mode (LORAPLEX_KERNELS, `set_mode`) with the CPU's
    sdpa attention form: what direct calls, tools and tests use. An engine builds its own
    (engine/step/model_runner.py), taking this mode when it starts."""
    return KernelBackend(mode=_mode)


class UsesBackend:
    """For modules that run kernels: `backend` is the one an engine bound to the module
    (kernels.backend.bind), else the process default at the time of the call."""

    _bound: KernelBackend | None = None

    @property
    def backend(self) -> KernelBackend:
        return self._bound if self._bound is not None else default_backend()

    @backend.setter
    def backend(self, value: KernelBackend | None) -> None:
        self._bound = value


def _op(name: str) -> Callable:
    """The default backend's op `name`, with the reference's docstring; a `memo` argument
    (the former per-step cache) is accepted and ignored: a call without a plan plans for
    itself."""
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, memo: dict | None = None, **kwargs):
        return getattr(default_backend(), name)(*args, **kwargs)

    return op


write_kv_cache = _op("write_kv_cache")
paged_attention = _op("paged_attention")
lora_apply = _op("lora_apply")
int8_matmul = _op("int8_matmul")
int4_matmul = _op("int4_matmul")
grouped_mm = _op("grouped_mm")
