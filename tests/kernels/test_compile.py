"""Every Triton kernel compiles to sm_90 code without a GPU (separate process, no interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # bf16 is the serving dtype and the one the interpreter cannot check.
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.kernels.compile_check", "--arch", "90",
         "--dtypes", "bf16"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kernels = {line.split()[1] for line in lines if line.startswith("ok")}
    assert kernels == {
        "sgmv_shrink", "sgmv_expand", "write_kv_cache", "paged_attention",
        "paged_attention_combine", "int8_matmul", "int4_matmul", "int8_gemv", "int4_gemv",
        "paged_attention_sinks", "grouped_mm", "add_rms_norm", "rope_and_write_kv",
        "silu_mul",
    }  # fmt: skip
