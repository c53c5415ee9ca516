"""Hugging Face's `kernels` package, imported before our root `kernels/` folder can shadow it.

A process started from the repository root (pytest, `python -m benchmarks.…`) has the root on
sys.path, where the folder `kernels/` (installed as `loraplex.kernels`) would be found as the
top-level `kernels` that transformers imports. Both the tests' conftest and the lab call this
first.
"""

from __future__ import annotations

import sys
from contextlib import suppress
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_installed_kernels() -> None:
    """Import Hugging Face's `kernels` package (transformers >= 5.25 imports it on first use)
    with the checkout's root off sys.path, where our kernels/ folder would stand in for it;
    later imports then get the installed one. Nothing happens where it is not installed."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]
    try:
        with suppress(ImportError):  # older transformers do without it
            import kernels  # noqa: F401
    finally:
        sys.path[:] = saved
