"""docs/benchmarks.md shows `python -m benchmarks.long_outputs`'s results files: the served /
offline figure per case, the command that made it and the file's notes (e.g. which code it
measured)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.docs import render

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_long_results_are_on_the_page(tmp_path):
    doc = json.loads((RESULTS / "long-tiny-llama.json").read_text())
    doc["command"] = "python -m benchmarks.long_outputs --cases issue --repeats 3"
    doc["notes"] = ["before the change"]
    (tmp_path / "long-x.json").write_text(json.dumps(doc))
    shutil.copy(RESULTS / "long-tiny-llama.json", tmp_path / "long-y.json")
    page = render(tmp_path, tmp_path / "benchmarks.md")
    row = doc["rows"][0]
    assert (
        "## Long outputs through the engine process (`python -m benchmarks.long_outputs`)" in page
    )
    assert f"| 1 x 8,192 tokens | {row['served_over_offline']:.2f} |" in page
    assert "`python -m benchmarks.long_outputs --cases issue --repeats 3`" in page
    assert "- before the change" in page and page.count("### `long-") == 2
