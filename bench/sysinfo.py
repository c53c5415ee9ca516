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
        # "AMD EPYC" names several generations (Zen 4 and Zen 5 both): family and model tell.
        for key, name in (("cpu family", "cpu_family"), ("model", "cpu_model")):
            info[name] = next(
                int(ln.split(":", 1)[1]) for ln in lines if ln.split(":")[0].strip() == key
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
