"""The structured-output benchmarks' plan and pages (the runs themselves need the demo model:
`python -m benchmarks.structured_acceptance`, `python -m benchmarks.structured`)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from benchmarks import structured, structured_acceptance
from benchmarks.docs import SECTIONS


def test_the_plan_covers_every_combination_evenly():
    reqs = structured_acceptance.plan(48, "base")
    combos = {(r["model"], r["stream"], r["endpoint"], r["schema"]) for r in reqs}
    assert len(combos) == 48  # 3 models x streamed or not x 2 endpoints x 4 schemas
    assert {r["model"] for r in reqs} == {"base", *structured_acceptance.ADAPTERS}


@pytest.mark.parametrize("name", list(structured_acceptance.SCHEMAS))
def test_every_schema_is_valid_and_bounded(name):
    schema = structured_acceptance.SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)

    def bounded(s: dict) -> bool:  # an answer must close well within max_tokens
        kind = s.get("type")
        if "enum" in s or kind == "boolean":
            return True
        if kind == "string":
            return "maxLength" in s or "pattern" in s
        if kind == "integer":
            return "maximum" in s and "minimum" in s
        if kind == "array":
            return "maxItems" in s and bounded(s["items"])
        if kind == "object":
            return s.get("additionalProperties") is False and all(
                bounded(p) for p in s["properties"].values()
            )
        return False

    assert bounded(schema)


def test_results_render_as_docs_sections(tmp_path):
    results = [
        {**r, "outcome": "valid", "completion_tokens": 30}
        for r in structured_acceptance.plan(12, "base")
    ]
    results[0]["outcome"] = "length"
    doc = {"model": "m", "adapters": ["pirate", "shout"], "requests": 12, "concurrency": 4,
           "temperature": 0.8, "max_tokens": 200, "wall_s": 1.0, "completion_tokens": 360,
           "summary": structured_acceptance.summarize(results), "results": results}  # fmt: skip
    page = structured_acceptance.section(doc, Path("structured-acceptance.json"), tmp_path)
    assert "**Valid: 11 / 12**" in page
    assert "cut by max_tokens 1" in page
    mask = {"model": "m", "vocab": 1000, "batch": 32, "tokens": 24, "dtype": "float32",
            "free_ms": [10.0, 12.0], "constrained_ms": [11.0, 13.0], "ratio": 1.0909}  # fmt: skip
    assert "+9.1 %" in structured.section(mask, Path("structured-bitmask-x.json"), tmp_path)
    prefixes = [prefix for _, prefix, _ in SECTIONS]
    assert "structured-acceptance" in prefixes and "structured-bitmask" in prefixes
