"""The docs runner fails a block whose page no longer says what it does: a status, a JSON
answer, a CLI line or table cell that changed, a command that fails, a marker it cannot read."""

from __future__ import annotations

import os

import pytest

from tests.docs import runner
from tests.docs.blocks import Marker
from tests.docs.conftest import DocsServer

SHOWN_404 = """\
curl -s -X DELETE $URL/v1/nowhere \\
  -H "Authorization: Bearer x"
# 404 {"error":{"message":"...","type":"not_found_error",
#      "code":"not_found"}}
"""


def test_a_shown_answer_is_parsed_with_its_status_and_continuation():
    steps = runner.shell_steps("export A=1\n# a note, not an output\n" + SHOWN_404)
    assert [s.command.split()[0] for s in steps] == ["export", "curl"]
    assert steps[0].output is None and steps[1].status == 404
    assert steps[1].output == (
        '{"error":{"message":"...","type":"not_found_error", "code":"not_found"}}'
    )


def test_shell_blocks_check_status_answer_and_exit(docs_server: DocsServer, tmp_path):
    env = {**os.environ, "URL": docs_server.url}
    runner.run_shell(SHOWN_404, tmp_path, env)  # as shown
    with pytest.raises(AssertionError, match="the page shows 405"):
        runner.run_shell(SHOWN_404.replace("# 404", "# 405"), tmp_path, env)
    with pytest.raises(AssertionError, match="the page shows"):
        runner.run_shell(SHOWN_404.replace('"not_found"}}', '"gone"}}'), tmp_path, env)
    with pytest.raises(AssertionError):  # a 4xx the page does not show
        runner.run_shell("curl -s $URL/v1/nowhere\n", tmp_path, env)
    with pytest.raises(AssertionError, match="exit status 3"):
        runner.run_shell("echo fine\nbash -c 'exit 3'\necho after\n", tmp_path, env)


def test_json_shown_matches_with_ellipses_and_left_out_keys():
    shown = {"object": "adapter.alias", "weights": {"v1": 90}, "updated_at": "..."}
    actual = {"object": "adapter.alias", "weights": {"v1": 90}, "updated_at": "2026", "x": 1}
    assert runner.matches(shown, actual)
    assert not runner.matches(shown, {**actual, "weights": {"v1": 100}})
    assert not runner.matches(shown, {"object": "adapter.alias", "weights": {"v1": 90}})
    assert not runner.matches([1, "..."], [1])


TABLE = [
    "TENANT  NAME  VERSION  RANK  BYTES  SHA256        CREATED",
    "acme    sql   v1       4     9311   c4ff6b23f089  2026-12-06 09:57",
    "",
    "sql@default -> v2 100 (was v1 90, v2 10)",
]


def test_console_output_compares_cells_except_the_volatile_columns():
    other_run = [
        "TENANT  NAME  VERSION  RANK  BYTES   SHA256        CREATED",
        "acme    sql   v1       4     12840   0b8b6afa95a9  2027-01-01 00:00",
        "",
        "sql@default -> v2 100 (was v1 90, v2 10)",
    ]
    assert runner.same_output(TABLE, other_run)
    assert not runner.same_output(TABLE, [line.replace("v1 ", "v2 ") for line in other_run])
    assert not runner.same_output(TABLE, [*other_run[:3], "sql@default -> v2 100"])
    assert not runner.same_output(TABLE, other_run[:2])


def test_markers_read_and_refused():
    assert Marker.parse("skip (needs  a GPU)", "x").skip == "needs a GPU"
    m = Marker.parse("tenant=acme setup=sql-split,my-adapter", "x")
    assert (m.tenant, m.setup, m.skip) == ("acme", ["sql-split", "my-adapter"], None)
    with pytest.raises(ValueError, match="write the reason"):
        Marker.parse("skip", "page.md:3")
    with pytest.raises(ValueError, match="unknown docs-test marker 'gpu'"):
        Marker.parse("gpu", "page.md:3")
