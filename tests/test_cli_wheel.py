"""The wheel as a user installs it: built from the package's folders, unpacked outside the
checkout and run from there, every `loraplex.*` module in it imports (from the wheel, not the
checkout), it holds none of the lab, and its CLI answers --help and the registry commands
without importing torch or the engine.

The dependencies come from this venv's site-packages, added by a .pth file to a venv of its own,
so this venv's editable install of loraplex (its finder runs from a .pth there) is not seen.
scripts/smoke_first_run.sh does the same with real `pip install`s in fresh venvs (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
# Imports every module of the unpacked wheel at argv[1]; prints how many, those that failed and
# those that came from anywhere else (JSON).
IMPORT_ALL = """
import importlib, json, sys
from pathlib import Path
root = Path(sys.argv[1]).resolve()
names = sorted(
    ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for p in (root / "loraplex").rglob("*.py")
)
# alembic's env.py runs inside alembic only; `db upgrade` below runs it there.
names.remove("loraplex.migrations.env")
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = repr(e)[:300]
elsewhere = [
    n for n in names
    if n in sys.modules and getattr(sys.modules[n], "__file__", None)
    and not Path(sys.modules[n].__file__).resolve().is_relative_to(root)
]
print(json.dumps({"modules": names, "failed": failed, "elsewhere": elsewhere}))
"""
# The CLI from the wheel: --help (and its time), then registry commands; which heavy modules
# each left in sys.modules (JSON).
CLI = """
import json, sys, time
t0 = time.perf_counter()
from loraplex.platform.cli import main
results = []
for argv in (["--help"], ["db", "upgrade"], ["tenants", "create", "acme"], ["tenants", "list"]):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    # `loraplex.engine` itself is light (its names load lazily); its engine proper is not.
    heavy = [m for m in ("torch", "loraplex.engine.llm_engine", "transformers") if m in sys.modules]
    results.append({"argv": argv, "code": code, "heavy": heavy,
                    "s": time.perf_counter() - t0})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> tuple[Path, Path, dict[str, str], Path]:
    """(the unpacked wheel, its venv's python, the environment, a folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building in the checkout leaves build/ there, stale files in it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in set(PACKAGE_DIRS.values()):
        shutil.copytree(REPO / folder, src / folder, ignore=skip)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(src), "-w", str(tmp / "dist")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("loraplex-*.whl")
    unpacked = tmp / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp / "outside"
    outside.mkdir()
    # A user's environment: none of ours, nor the TRITON_INTERPRET the tests' conftest sets
    # (kernels/compile_check.py refuses it on import).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LORAPLEX_", "PYTHON")) and k != "TRITON_INTERPRET"
    }
    env |= {
        "PYTHONPATH": str(unpacked),
        "PYTHONDONTWRITEBYTECODE": "1",  # the unpacked wheel stays as it was built
        "LORAPLEX_DATA_DIR": str(tmp / "data"),
    }
    return unpacked, python, env, outside


def _run(wheel_env, code: str, *args: str) -> object:
    unpacked, python, env, outside = wheel_env
    out = subprocess.run(
        [python, "-c", code, *args], cwd=outside, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_module_of_the_wheel_imports_from_the_wheel(wheel_env):
    unpacked = wheel_env[0]
    result = _run(wheel_env, IMPORT_ALL, str(unpacked))
    assert result["failed"] == {}
    assert result["elsewhere"] == []
    assert {"loraplex.engine.llm", "loraplex.bench.serve"} <= set(result["modules"])


def test_the_wheel_holds_none_of_the_lab(wheel_env):
    unpacked = wheel_env[0]
    top = {p.name for p in unpacked.iterdir() if not p.name.endswith(".dist-info")}
    assert top == {"loraplex"}
    bench = unpacked / "loraplex" / "bench"
    assert {p.suffix for p in bench.rglob("*") if p.is_file()} == {".py"}  # no results, caches
    assert not (bench / "peers").exists() and not (bench / "assets.py").exists()


def test_the_wheels_cli_answers_without_torch(wheel_env):
    results = _run(wheel_env, CLI)
    assert [r["code"] for r in results] == [0, 0, 0, 0], results
    assert all(r["heavy"] == [] for r in results), results
    assert results[0]["s"] < 0.5, results  # import and --help, in this interpreter
