"""The lab's assets borrow tests/utils without letting the checkout's kernels/ folder stand in
for Hugging Face's `kernels` package (transformers >= 5.25 imports it on first use)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.assets import REPO_ROOT

CHECK = """
import importlib.metadata, sys
from benchmarks import assets
before = list(sys.path)
assets.factories().make_tokenizer
assert sys.path == before, (sys.path, before)
import transformers
transformers.LlamaConfig  # imports transformers.activations, which imports `kernels`
try:
    importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    import kernels
    assert "site-packages" in kernels.__file__, kernels.__file__
print("ok")
"""


def test_factories_keep_hf_kernels_when_run_from_the_checkout():
    # cwd = the checkout, whose root `python -c` puts first on sys.path: the worst case.
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
