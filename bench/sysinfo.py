"""A description of the machine a benchmark ran on, for the JSON results and the docs."""

from __future__ import annotations

import contextlib
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
    with contextlib.suppress(OSError):
        info.update(cpu_info(Path("/proc/cpuinfo").read_text()))
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def cpu_info(text: str) -> dict:
    """The first processor of a /proc/cpuinfo: name, AVX2/AVX-512/AMX flags, family and model
    (where the kernel reports them; "AMD EPYC" names Zen 4 and Zen 5 alike)."""
    fields: dict[str, str] = {}
    for ln in text.splitlines():
        key, sep, value = ln.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    info: dict = {}
    if "model name" in fields:
        info["cpu"] = fields["model name"]
    if "flags" in fields:
        flags = fields["flags"].split()
        info["isa"] = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")
    for key, name in (("cpu family", "cpu_family"), ("model", "cpu_model")):
        if fields.get(key, "").isdigit():
            info[name] = int(fields[key])
    return info
