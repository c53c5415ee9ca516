"""The kernel backend a module runs, and the ops for direct calls (tools, tests).

An engine runs its kernels through its own `KernelBackend` (kernels/backend.py) in the mode
its `kernel_mode` option names, bound to its model's modules (`backend.bind`). A module no
engine bound, and the functions here, run `DEFAULT`: mode "auto" (Triton on CUDA tensors,
the CPU backend elsewhere), a frozen value that nothing changes. A caller that wants another
mode makes its own `KernelBackend(mode=...)`; there is no process-wide switch. Each op keeps
the reference's signature, semantics and docstring (see `reference.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from loraplex.kernels import reference
from loraplex.kernels.backend import KernelBackend

DEFAULT = KernelBackend()


class UsesBackend:
    """For modules that run kernels: `backend` is the one an engine bound to the module
    (kernels.backend.bind), else `DEFAULT`."""

    _bound: KernelBackend | None = None

    @property
    def backend(self) -> KernelBackend:
        return self._bound if self._bound is not None else DEFAULT

    @backend.setter
    def backend(self, value: KernelBackend | None) -> None:
        self._bound = value


def _op(name: str) -> Callable:
    """`DEFAULT`'s op `name`, with the reference's docstring."""
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        return getattr(DEFAULT, name)(*args, **kwargs)

    return op


write_kv_cache = _op("write_kv_cache")
paged_attention = _op("paged_attention")
lora_apply = _op("lora_apply")
int8_matmul = _op("int8_matmul")
int4_matmul = _op("int4_matmul")
grouped_mm = _op("grouped_mm")
