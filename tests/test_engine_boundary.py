"""The platform reaches the engine only through its public API (`loraplex.engine`'s exports),
so the engine's modules can move without breaking the server; and no error crosses the
boundary as text to be parsed (the engine raises types, engine/errors.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import loraplex.engine as engine

ROOT = Path(__file__).resolve().parents[1]
# What reading an error's text for its meaning looks like.
PARSING = re.compile(r"str\(e\)\.(split\([^)]|startswith|partition)|in str\(e\)|e\.args\[0\]\.")


def _platform_files() -> list[Path]:
    return sorted(p for p in (ROOT / "platform").rglob("*.py"))


def test_platform_imports_only_the_engines_public_names():
    reached_around = []
    for path in _platform_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("loraplex.engine."):
                    reached_around.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
                elif node.module == "loraplex.engine":
                    unknown = [a.name for a in node.names if a.name not in engine.__all__]
                    assert not unknown, f"{path}: {unknown} are not loraplex.engine's exports"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("loraplex.engine."):
                        reached_around.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not reached_around, "import these from loraplex.engine:\n" + "\n".join(reached_around)


def test_every_export_resolves():
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


def test_no_error_is_read_by_its_message():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _platform_files()
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if PARSING.search(line)
    ]
    assert not found, "decide by the exception's type and fields:\n" + "\n".join(found)
