"""`loraplex bench …` on a plain install: a command that needs the `bench` extra says which
one line to run, and stops before doing any work."""

from __future__ import annotations

import sys

import pytest

from loraplex.bench import scaling, serve
from loraplex.bench.peers import compare
from loraplex.platform import cli

EXTRA = "pip install 'loraplex[bench]'"


@pytest.fixture
def runs(monkeypatch) -> list[str]:
    """The bench runs started (none really run), with peft and matplotlib not installed."""
    for name in ("peft", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # find_spec answers None, import fails
    started: list[str] = []
    done = {"summary": {"completed": 1}}
    monkeypatch.setattr(serve, "run_serve", lambda args: started.append("serve") or done)
    monkeypatch.setattr(serve, "run_offline", lambda args: started.append("offline") or done)
    monkeypatch.setattr(scaling, "run_scaling", lambda args: started.append("scaling"))
    monkeypatch.setattr(compare, "run_compare", lambda args: started.append("peers"))
    return started


@pytest.mark.parametrize(
    ("argv", "needs"),
    [
        (["bench", "offline"], "peft and matplotlib"),
        (["bench", "offline", "--no-plot"], "peft"),
        (["bench", "scaling"], "peft and matplotlib"),
        (["bench", "peers", "--no-plot"], "peft"),
        (["bench", "serve", "--api-key", "k"], "matplotlib"),
    ],
)
def test_a_command_without_its_extra_names_it_and_stops(runs, argv, needs):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    message = stop.value.code
    assert isinstance(message, str) and "\n" not in message  # exit status 1, one line
    command = " ".join(argv[:2])
    assert message.startswith(f"loraplex: error: `loraplex {command}` needs {needs}: {EXTRA}")
    assert runs == []


def test_bench_serve_without_charts_needs_no_extra(runs):
    assert cli.main(["bench", "serve", "--api-key", "k", "--no-plot"]) == 0
    assert runs == ["serve"]


def test_bench_quant_is_a_subcommand_that_names_the_peer_extra(monkeypatch):
    from loraplex.bench import quant

    started = []
    monkeypatch.setattr(quant, "run_quant", lambda args: started.append(args.formats))
    monkeypatch.setitem(sys.modules, "hqq", None)  # the `quant-peers` extra not installed
    argv = ["bench", "quant", "--model", "m", "--no-plot"]
    with pytest.raises(SystemExit) as stop:
        cli.main([*argv, "--formats", "float32", "HQQ int4 g128"])
    assert stop.value.code.startswith("loraplex: error: the peer formats need hqq: ")
    assert "pip install 'loraplex[quant-peers]'" in stop.value.code
    assert started == []
    # Our own formats need no extra; the run gets what the command line chose.
    assert cli.main([*argv, "--formats", "float32", "ours int4 g128 (Hadamard + GPTQ)"]) == 0
    assert started == [["float32", "ours int4 g128 (Hadamard + GPTQ)"]]
