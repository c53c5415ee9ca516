"""What the lab's entry points share: stop early, naming the packages to install, when an
optional one a run needs is missing."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

EXTRA = "pip install -e '.[bench]'"


def require(
    command: str, *, adapters: bool, plot: bool = True, peers: tuple[str, ...] = ()
) -> None:
    """peft writes the generated adapters' configs, matplotlib draws the charts; `peers` are
    other optional modules (the peer quantizers of `benchmarks.quant`)."""
    needed = (["peft"] if adapters else []) + (["matplotlib"] if plot else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        hint = " (or pass --no-plot)" if missing == ["matplotlib"] else ""
        raise SystemExit(
            f"error: `python -m benchmarks.{command}` needs {' and '.join(missing)}: {EXTRA}{hint}"
        )
    missing = [m for m in peers if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"error: the peer formats need {' and '.join(missing)}: "
            "pip install -e '.[quant-peers]' (or leave them out of --formats)"
        )


def parser(
    doc: str | None, add_args: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """The script's options, their defaults shown in --help; its docstring's first paragraph
    as the description."""
    p = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_args(p)
    return p
