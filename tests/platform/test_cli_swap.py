"""--swap-space reaches the engine config from `serve` (via settings)."""

from __future__ import annotations

from loraplex.platform import cli
from loraplex.platform.main import engine_config


def test_serve_swap_space_reaches_the_engine(tiny_models):
    parser = cli.build_parser()
    model = str(tiny_models["llama"])
    default = engine_config(
        cli._settings(parser.parse_args(["serve", "--max-model-len", "256"])), model
    )
    assert default.swap_space_gib == 0 and default.preemption_mode == "auto"
    swap = engine_config(
        cli._settings(
            parser.parse_args(["serve", "--swap-space", "0.5", "--max-model-len", "256"])
        ),
        model,
    )
    assert swap.swap_space_gib == 0.5
