"""Import every module of the installed `loraplex` (each package that pyproject.toml lists),
then run `loraplex <command> --help` for every command and subcommand of the CLI.

    python scripts/check_install.py [path/to/pyproject.toml]

scripts/smoke_first_run.sh runs it in venvs that hold only the base dependencies, from a folder
outside the checkout, so a module that imports a package of an extra (`test`, `bench`) at its
top fails here as it would for a user. Skipped: alembic's env.py only (it runs only inside
alembic; `loraplex db upgrade` exercises it). The lab (benchmarks/) is not in the package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import subprocess
import sys
import tomllib
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NOT_IMPORTABLE = {"loraplex.migrations.env"}


def module_names(packages: list[str]) -> list[str]:
    """Every package and module of `packages`, in order (a failing package counts once)."""
    names: list[str] = []
    for pkg in packages:
        names.append(pkg)
        try:
            path = importlib.import_module(pkg).__path__
        except Exception:
            continue  # reported when `main` imports it
        for info in pkgutil.iter_modules(path, pkg + "."):
            if not info.ispkg and info.name not in names:
                names.append(info.name)
    return names


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every command path of the CLI: ("serve",), ("db", "upgrade"), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(sub, (*prefix, name))


def check_imports(pyproject: Path) -> list[str]:
    """The modules that fail to import (each reported on stderr)."""
    packages = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]
    skip = NOT_IMPORTABLE
    names = [n for n in module_names(packages) if n not in skip]
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as e:  # SystemExit too: a module must not exit on import
            failed.append(name)
            last = traceback.format_exception_only(e)[-1].strip()
            print(f"FAIL {name}: {last}", file=sys.stderr)
    where = Path(importlib.import_module("loraplex.engine").__file__).parent.parent
    print(
        f"imported {len(names) - len(failed)}/{len(names)} modules from {where} "
        f"(skipped {len(skip)}: {', '.join(sorted(skip))})"
    )
    return failed


def check_cli() -> list[str]:
    """The commands whose `--help` fails, each run as a user would (its own process)."""
    from loraplex.platform.cli import build_parser

    exe = Path(sys.executable).parent / "loraplex"
    paths = [(), *command_paths(build_parser())]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        runs = pool.map(
            lambda p: subprocess.run([exe, *p, "--help"], capture_output=True, text=True), paths
        )
    failed = []
    for path, run in zip(paths, runs, strict=True):
        if run.returncode != 0 or "usage: loraplex" not in run.stdout:
            failed.append(" ".join(path))
            tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(
                f"FAIL loraplex {' '.join(path)} --help: rc {run.returncode}: {tail}",
                file=sys.stderr,
            )
    print(f"{len(paths) - len(failed)}/{len(paths)} commands answer --help ({exe})")
    return failed


def main(argv: list[str]) -> int:
    default = Path(__file__).resolve().parents[1] / "pyproject.toml"
    failed = check_imports(Path(argv[1]) if len(argv) > 1 else default)
    if "loraplex.platform.cli" not in failed:
        failed += check_cli()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
