"""What `pip install loraplex` ships imports with the base dependencies alone.

Every module in a folder that pyproject maps into the package may import at its top only the
standard library, loraplex itself, and distributions that the base dependencies bring (their
own requirements included); a package of an extra (`test`, `bench`) is imported inside the
function that needs it. scripts/smoke_first_run.sh checks the same for real in fresh venvs
(CI); this is the quick form, read from the source with `ast`.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
GUARDS = {"ImportError", "ModuleNotFoundError"}


def _closure(requirements: list[str]) -> set[str]:
    """The distributions that installing `requirements` brings, as installed here."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        extras = sorted(req.extras) or [""]
        key = f"{name}[{','.join(extras)}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(r), e) for r in requires for e in ["", *extras]]
    return {k.split("[")[0] for k in seen}


@cache
def _providers() -> dict[str, set[str]]:
    """import name -> the distributions that provide it."""
    return {
        name: {canonicalize_name(d) for d in dists}
        for name, dists in metadata.packages_distributions().items()
    }


def _module_top_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level name) of each import that runs when the module is imported: not those
    in functions, under `if TYPE_CHECKING:`, or in a `try` that catches ImportError."""
    found: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.append((node.lineno, node.module.split(".")[0]))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
                if not any(g in c for c in caught for g in GUARDS):
                    visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With | ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return found


def _shipped_files() -> list[tuple[Path, str]]:
    """(file, its module name) of every .py file in the folders pyproject maps."""
    files = []
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            files.append((path, ".".join([package, *parts])))
    return files


def _extra_of(dist: str) -> str:
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items():
        if dist in {canonicalize_name(Requirement(r).name) for r in reqs}:
            return f"the `{extra}` extra"
    return "no dependency of loraplex"


def test_runtime_modules_import_only_base_dependencies_at_their_top():
    base = _closure(PYPROJECT["project"]["dependencies"])
    assert "fastapi" in base and "pytest" not in base, "the closure walked the wrong packages"
    bad = []
    local = {"loraplex", "__future__"}
    for path, _ in _shipped_files():
        for line, name in _module_top_imports(ast.parse(path.read_text(), str(path))):
            if name in local or name in sys.stdlib_module_names:
                continue
            dists = _providers().get(name, set())
            if not dists & base:
                where = ", ".join(sorted(_extra_of(d) for d in dists)) or "nothing installed"
                bad.append(
                    f"{path.relative_to(REPO)}:{line} imports {name} at its top ({where}); "
                    "import it inside the function that needs it, or add it to dependencies"
                )
    assert not bad, "\n".join(bad)


def test_every_source_folder_is_a_listed_package():
    """A folder of .py files missing from `packages` is silently left out of the wheel."""
    listed = set(SETUPTOOLS["packages"])
    folders = {module.rsplit(".", 1)[0] for _, module in _shipped_files()}
    assert folders - listed == set(), "add these to [tool.setuptools] packages"
