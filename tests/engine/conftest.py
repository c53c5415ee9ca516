"""Engine-only fixtures: the families beyond the four every suite builds (factories' FAMILY_KINDS),
made on first use so that other suites do not pay for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.factories import FAMILY_KINDS, make_adapter, make_tiny_model
from tests.conftest import ADAPTER_SPECS


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    return {
        kind: make_tiny_model(kind, root / kind, seed=20 + i) for i, kind in enumerate(FAMILY_KINDS)
    }


@pytest.fixture(scope="session")
def family_adapters(family_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """kind -> adapter name -> folder: conftest's four specs (phi3's name its fused modules)."""
    root = tmp_path_factory.mktemp("family-adapters")
    return {
        kind: {
            name: make_adapter(base, root / kind / name, seed=10 + j, **spec)
            for j, (name, spec) in enumerate(ADAPTER_SPECS.items())
        }
        for kind, base in family_models.items()
    }


@pytest.fixture(scope="session")
def parity_models(tiny_models, family_models) -> dict[str, Path]:
    return {**tiny_models, **family_models}


@pytest.fixture(scope="session")
def parity_adapters(tiny_adapters, family_adapters) -> dict[str, dict[str, Path]]:
    return {**tiny_adapters, **family_adapters}


@pytest.fixture
def reference_mode(monkeypatch):
    """The kernels' exact forms (the torch reference) for engines built in the test (their
    `kernel_mode` option's default, LORAPLEX_KERNELS): the CPU's fast int8/int4 products round
    differently from a matmul on the dequantized weights."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "reference")
