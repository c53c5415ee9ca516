"""`loraplex bench serve` on a plain install: without matplotlib it says which one line to run
and stops before doing any work, unless charts are turned off. The lab's other benchmarks are
not commands of the installed tool (benchmarks/, tests/bench/test_entry_points.py)."""

from __future__ import annotations

import sys

import pytest

from loraplex.bench import serve
from loraplex.platform import cli

EXTRA = "pip install 'loraplex[bench]'"


@pytest.fixture
def runs(monkeypatch) -> list[str]:
    """The bench runs started (none really run), with matplotlib not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec answers None
    started: list[str] = []
    done = {"summary": {"completed": 1}}
    monkeypatch.setattr(serve, "run_serve", lambda args: started.append("serve") or done)
    return started


def test_bench_serve_without_matplotlib_names_the_extra_and_stops(runs):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "serve", "--api-key", "k"])
    message = stop.value.code
    assert isinstance(message, str) and "\n" not in message  # exit status 1, one line
    assert message.startswith(f"loraplex: error: `loraplex bench serve` draws its chart with "
                              f"matplotlib: {EXTRA} (or pass --no-plot)")  # fmt: skip
    assert runs == []


def test_bench_serve_without_charts_needs_no_extra(runs):
    assert cli.main(["bench", "serve", "--api-key", "k", "--no-plot"]) == 0
    assert runs == ["serve"]


@pytest.mark.parametrize("lab", ["offline", "scaling", "peers", "cliff", "quant", "docs"])
def test_the_lab_is_not_a_command_of_the_installed_tool(lab, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", lab])
    assert stop.value.code == 2
    assert f"invalid choice: '{lab}'" in capsys.readouterr().err


def test_bench_serve_results_default_to_the_data_dir(monkeypatch, tmp_path):
    """Never under the installed package: `<data dir>/bench-results` unless --out says."""
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    args = cli.build_parser().parse_args(["bench", "serve"])
    assert args.out is None
    assert serve.default_out() == tmp_path / "bench-results"
