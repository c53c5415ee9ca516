"""The load-and-fault suite at a tenant's scale (200 streams), with its figures as a table.

    .venv/bin/python scripts/soak.py            # full size; about 5 minutes on 2 cores
    .venv/bin/python scripts/soak.py --small    # the size CI runs

Runs `pytest tests/load` (real servers on loopback, PostgreSQL at 127.0.0.1:5432 when it
answers, else SQLite) and prints what each scenario measured; docs/security.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CI's size instead of the full one")
    args = ap.parse_args()
    artifacts = Path(tempfile.mkdtemp(prefix="loraplex-soak-"))
    env = {**os.environ, "LORAPLEX_SOAK": "small" if args.small else "full",
           "LORAPLEX_ARTIFACTS": str(artifacts)}  # fmt: skip
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "tests/load"], cwd=ROOT,
                         env=env)  # fmt: skip
    results = artifacts / "soak.json"
    if not results.is_file():
        print("no figures were written", file=sys.stderr)
        return rc or 1
    data = json.loads(results.read_text())
    print(f"\n| scenario ({data['size']} size) | figures |\n|---|---|")
    for scenario, figures in data["results"].items():
        print(f"| {scenario} | " + ", ".join(f"{k} {v}" for k, v in figures.items()) + " |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
