#!/usr/bin/env bash
# GPU checks for the Triton kernels (issue 4), run from the repository root on a CUDA machine:
#   1. pytest -m gpu tests/kernels      bf16, serving-sized shapes, CUDA-graph replay == eager
#   2. the interpreter-sized kernel tests, compiled for this GPU instead of interpreted
#   3. bench/kernels.py                 SGMV / paged attention / dequant GEMV figures
#   4. bench/gpu_engine.py              8B-shaped random Llama, bf16, 32 adapters of rank 16
# Each step has its own time limit so the whole script stays under 8 minutes; a failing step
# is reported and the next one still runs. Logs and JSON/PNG land in bench/results/.
#
# Python: $PYTHON if set; else .venv/bin/python when it sees a GPU; else a fresh
# /tmp/loraplex-venv on top of the system's CUDA torch + triton with this repo installed
# without dependencies (works offline); LORAPLEX_PIP_INSTALL=1 instead runs
# `python3 -m venv .venv && .venv/bin/pip install -e '.[test]'` (needs the package index).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# "0", not unset: tests/conftest.py turns the interpreter on when it finds no /dev/nvidiactl,
# which a GPU machine's sandbox may not expose even though CUDA works.
export TRITON_INTERPRET=0
mkdir -p bench/results
LOG=bench/results/gpu_check.log
: >"$LOG"

has_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

PY=${PYTHON:-}
if [ -z "$PY" ] && [ -x .venv/bin/python ] && has_gpu .venv/bin/python; then
    PY=.venv/bin/python
fi
if [ -z "$PY" ] && [ "${LORAPLEX_PIP_INSTALL:-0}" = 1 ]; then
    python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && PY=.venv/bin/python
fi
# The device image's python3 is itself a venv holding CUDA torch + triton: a venv made from it
# with --system-site-packages would see the base interpreter's packages, not those; install
# this checkout into it directly (the machine is thrown away after the lease).
if [ -z "$PY" ] && has_gpu python3; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . && PY=python3
fi
if [ -z "$PY" ]; then
    python3 -m venv --system-site-packages /tmp/loraplex-venv &&
        /tmp/loraplex-venv/bin/pip install -q --no-deps --no-build-isolation -e . &&
        PY=/tmp/loraplex-venv/bin/python
fi
if [ -z "$PY" ] || ! has_gpu "$PY"; then
    echo "gpu_check: no Python with a CUDA torch found (set PYTHON=...)" | tee -a "$LOG"
    exit 2
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  torch.cuda.get_device_name())' | tee -a "$LOG"

FAILED=()
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
    [ "$rc" = 0 ] || FAILED+=("$name")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
step "gpu tests" 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels \
    tests/engine/test_quantization.py
step "kernel tests compiled" 90 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_sgmv.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_dequant_matmul.py tests/kernels/test_dispatch.py
step "kernel bench" 90 "$PY" bench/kernels.py
step "engine batch 64" 100 "$PY" bench/gpu_engine.py --batch 64
step "engine batch 32" 80 "$PY" bench/gpu_engine.py --batch 32 --prompt-len 1024

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${FAILED[*]}" | tee -a "$LOG"
    exit 1
fi
echo "gpu_check: all steps passed" | tee -a "$LOG"
