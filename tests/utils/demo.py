"""The converted demo model (Gemma 3 270M), shared by every test that needs real weights.

The first conversion takes about a minute and 0.5 GB; later runs reuse the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.engine.models.demo import prepare_demo


def data_dir_for(cache_root: Path) -> Path:
    return Path(os.environ.get("LORAPLEX_DATA_DIR") or cache_root)


def get_demo_model_dir(cache_root: Path) -> Path:
    """Converted folder under `$LORAPLEX_DATA_DIR` if set, else under `cache_root`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return prepare_demo(data_dir_for(cache_root))


def get_demo_adapters_dir(cache_root: Path) -> Path:
    """The trained demo adapters (a few minutes the first time), where `serve` keeps them."""
    from loraplex.platform.demo.adapters import prepare_demo_adapters

    out = data_dir_for(cache_root) / "demo-adapters"
    prepare_demo_adapters(get_demo_model_dir(cache_root), out)
    return out
