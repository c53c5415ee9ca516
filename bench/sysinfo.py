"""A description of the machine a benchmark ran on, for the JSON results and the docs."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> dict:
    info: dict = {
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = text.splitlines()
        info["cpu"] = next(
            ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")
        )
        flags = next(ln for ln in lines if ln.startswith("flags")).split()
        info["isa"] = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")
    except (OSError, StopIteration):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info
