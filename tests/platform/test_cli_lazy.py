"""The CLI answers at once: `loraplex --help` and the registry commands never import torch or
the engine (nor, for --help, the registry itself); a subcommand imports what it needs when it
runs. Each check is a fresh interpreter, as a user's shell starts one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loraplex.platform import cli_admin
from loraplex.platform.db.models import TenantStatus
from loraplex.platform.db.schemas import QuotaBase

# The engine proper; `loraplex.engine` itself loads its names lazily and its option table
# (engine/options.py, which `serve --help` reads) is standard library only.
HEAVY = ("torch", "loraplex.engine.llm_engine", "transformers", "numpy", "triton")

# Builds the parser, runs each argv of a JSON list through main() in turn and prints, per
# command, its exit status and which of HEAVY and of the registry's libraries were imported by
# then (JSON, the last line).
PROBE = f"""
import json, sys
from loraplex.platform.cli import build_parser, main
build_parser()
results = []
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as e:  # --help exits 0
        code = e.code
    loaded = [m for m in {HEAVY} + ("sqlalchemy", "pydantic", "httpx") if m in sys.modules]
    results.append({{"code": code, "loaded": loaded}})
print(json.dumps(results))
"""


def _probe(commands: list[list[str]], data_dir: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env["LORAPLEX_DATA_DIR"] = str(data_dir)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(commands)],
        cwd=data_dir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_neither_the_engine_nor_the_registry(tmp_path):
    for argv in (["--help"], ["tenants", "--help"], ["bench", "serve", "--help"]):
        assert _probe([argv], tmp_path) == [{"code": 0, "loaded": []}], argv


def test_admin_commands_never_import_torch_or_the_engine(tmp_path):
    commands = [
        ["db", "upgrade"],
        ["tenants", "create", "acme"],
        ["tenants", "list"],
        ["keys", "create", "--tenant", "acme"],
        ["quotas", "set", "--tenant", "acme", "--max-rank", "16"],
        ["adapters", "list"],
        ["usage", "export"],
    ]
    for argv, result in zip(commands, _probe(commands, tmp_path), strict=True):
        assert result["code"] == 0, argv
        assert "sqlalchemy" in result["loaded"]  # it did reach the registry
        assert not set(result["loaded"]) & set(HEAVY), (argv, result["loaded"])


def test_help_answers_in_under_half_a_second(tmp_path):
    exe = Path(sys.executable).parent / "loraplex"
    times = []
    for _ in range(3):  # the best of three: the machine is shared with other work
        t0 = time.perf_counter()
        out = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        assert out.returncode == 0 and "usage: loraplex" in out.stdout
    assert min(times) < 0.5, times


def test_the_parsers_constants_match_the_registry():
    """The parser writes these out so as not to import the registry; they must agree."""
    assert tuple(s.value for s in TenantStatus) == cli_admin.TENANT_STATUSES
    assert list(QuotaBase.model_fields) == cli_admin.QUOTA_FIELDS
