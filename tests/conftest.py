"""Shared fixtures: tiny random models and PEFT adapters, built once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each engine picks its own CPU attention form ("auto" times both at its start), and the two
# forms round differently: tests that compare engines with each other bitwise need one form.
# Tests of "auto" itself ask for it by name.
os.environ.setdefault("LORAPLEX_CPU_ATTENTION", "sdpa")
# Triton reads TRITON_INTERPRET when `triton.language` is first imported, which libraries
# (transformers, peft, torch's compiler) may do while test modules are collected: set it here,
# before anything else, on machines without an NVIDIA GPU (tests/kernels/conftest.py is late).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

from testkit.hf_kernels import import_installed_kernels  # noqa: E402

# pytest puts the checkout's root on sys.path, where our kernels/ folder (loraplex.kernels)
# would stand in for Hugging Face's `kernels` package: import the installed one first.
import_installed_kernels()

import pytest  # noqa: E402
import torch  # noqa: E402

from testkit.factories import make_adapter, make_tiny_model  # noqa: E402
from tests.utils.demo import get_demo_adapters_dir, get_demo_model_dir  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Four adapters that differ in rank, targets and scaling, for mixed batches.
ADAPTER_SPECS = {
    "qv4": dict(r=4, alpha=8, targets=("q_proj", "v_proj")),
    "attn8": dict(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp16": dict(r=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True),
    "all2": dict(
        r=2,
        alpha=4,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        kind: make_tiny_model(kind, root / kind, seed=i, shard=(kind == "qwen2"))
        for i, kind in enumerate(("llama", "qwen2", "gemma3", "mistral"))
    }


@pytest.fixture(scope="session")
def tiny_adapters(tiny_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """kind -> adapter name -> folder."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        kind: {
            name: make_adapter(base, root / kind / name, seed=10 + j, **spec)
            for j, (name, spec) in enumerate(ADAPTER_SPECS.items())
        }
        for kind, base in tiny_models.items()
    }


@pytest.fixture(scope="session")
def demo_model_dir(request: pytest.FixtureRequest) -> Path:
    """The converted Gemma 3 270M, cached across runs in pytest's cache folder."""
    return get_demo_model_dir(request.config.cache.mkdir("loraplex-data"))


@pytest.fixture(scope="session")
def demo_adapters_dir(request: pytest.FixtureRequest) -> Path:
    """The demo adapters `serve` trains (pirate, shout), trained once and cached like the model."""
    return get_demo_adapters_dir(request.config.cache.mkdir("loraplex-data"))
