"""schemathesis against the running server's own OpenAPI document: every operation, with a
tenant's key, another tenant's key, a forged key and the admin key. No answer may be a 5xx, and
every answer must match what the document says (status codes, content types, bodies, headers).

One check is left out: `positive_data_acceptance` (a body the schema allows must be accepted).
Which `model` names exist and what an uploaded adapter file holds are state, not schema, so
schema-valid requests are rightly refused (404 unknown model, 400 not an adapter).

`LORAPLEX_FUZZ_EXAMPLES` sets the examples per operation (CI: the small default)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.server import ADMIN_KEY, run_server

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "8"))
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


@pytest.fixture(scope="module")
def fuzz_server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("fuzz"),
                    max_model_len=128) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def keys(fuzz_server):
    # The adapters and keys schemathesis creates with one tenant's key are then probed with
    # the other tenant's: still no 5xx, and nothing of one is visible to the other.
    return {"tenant": fuzz_server.new_tenant("fuzz-a")[1], "forged": "lpx_" + "f" * 43,
            "other-tenant": fuzz_server.new_tenant("fuzz-b")[1], "admin": ADMIN_KEY}  # fmt: skip


# Two runs at a time: each is a client and a server taking turns on one core, so a pair keeps
# both cores busy. The tenant's run ends before the other tenant's starts (what the first
# created is there for the second to probe); the forged key and the admin run beside them.
PAIRS = (("tenant", "forged"), ("other-tenant", "admin"))


@pytest.fixture(scope="module")
def runs(fuzz_server, keys, tmp_path_factory):
    """`who` -> its schemathesis process, started with its pair when the first of the two is
    asked for; each test then waits for its own."""
    started: dict[str, tuple[subprocess.Popen, Path]] = {}

    def run(who: str) -> tuple[int, str]:
        for name in next(pair for pair in PAIRS if who in pair):
            if name not in started:
                # Output to a file, not a pipe: a full pipe would stall the run not waited on.
                folder = tmp_path_factory.mktemp(f"fuzz-{name}")
                with (folder / "out.txt").open("w") as out:
                    proc = subprocess.Popen(
                        [str(SCHEMATHESIS), "run", f"{fuzz_server.url}/openapi.json", "--checks",
                         "all", "--exclude-checks", "positive_data_acceptance", "--max-examples",
                         str(EXAMPLES), "--seed", "20261204", "-H",
                         f"Authorization: Bearer {keys[name]}", "--no-color"],
                        stdout=out, stderr=subprocess.STDOUT, text=True, cwd=folder,
                    )  # fmt: skip
                started[name] = proc, folder / "out.txt"
        proc, out = started[who]
        return proc.wait(timeout=600), out.read_text()

    yield run
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("who", ["tenant", "other-tenant", "forged", "admin"])
def test_no_5xx_and_answers_match_the_document(runs, who):
    returncode, out = runs(who)
    assert returncode == 0, out[-6000:]
    tested = re.search(r"Tested: (\d+)", out)
    cases = re.search(r"(\d+) generated, (\d+) passed", out)
    assert tested and int(tested.group(1)) >= 20 and cases, out[-3000:]
    artifacts = Path(os.environ.get("LORAPLEX_ARTIFACTS", "/tmp/artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / f"fuzz-{who}.json").write_text(json.dumps(
        {"credential": who, "operations": int(tested.group(1)), "cases": int(cases.group(1)),
         "passed": int(cases.group(2)), "examples_per_operation": EXAMPLES}))  # fmt: skip
