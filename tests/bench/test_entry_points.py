"""The lab's entry points (`python -m benchmarks.<name>`): a run that needs the `bench` extra
(peft writes the adapters, matplotlib the charts) or a peer quantizer names what to install
and stops before doing any work."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from benchmarks import quant
from benchmarks.assets import REPO_ROOT

EXTRA = "pip install -e '.[bench]'"


@pytest.mark.parametrize(
    ("module", "run", "argv", "needs"),
    [
        ("benchmarks.replay_engine", "run_engine_replay", [], "peft and matplotlib"),
        ("benchmarks.replay_engine", "run_engine_replay", ["--no-plot"], "peft"),
        ("benchmarks.scaling", "run_scaling", [], "peft and matplotlib"),
        ("benchmarks.peers.compare", "run_compare", ["--no-plot"], "peft"),
        ("benchmarks.cliff", "run_cliff", [], "peft and matplotlib"),
        ("benchmarks.fleet", "run_fleet", ["--no-plot"], "peft"),
    ],
)
def test_a_run_without_its_extra_names_it_and_stops(monkeypatch, module, run, argv, needs):
    for name in ("peft", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # find_spec answers None, import fails
    mod = importlib.import_module(module)
    started = []
    monkeypatch.setattr(mod, run, lambda args: started.append(args))
    with pytest.raises(SystemExit) as stop:
        mod.main(argv)
    message = stop.value.code
    assert isinstance(message, str) and "\n" not in message
    name = module.removeprefix("benchmarks.")
    assert message.startswith(f"error: `python -m benchmarks.{name}` needs {needs}: {EXTRA}")
    assert started == []


def test_quant_names_the_peer_extra(monkeypatch):
    started = []
    monkeypatch.setattr(quant, "run_quant", lambda args: started.append(args.formats))
    monkeypatch.setitem(sys.modules, "hqq", None)  # the `quant-peers` extra not installed
    argv = ["--model", "m", "--no-plot"]
    with pytest.raises(SystemExit) as stop:
        quant.main([*argv, "--formats", "float32", "HQQ int4 g128"])
    assert stop.value.code.startswith("error: the peer formats need hqq: ")
    assert "pip install -e '.[quant-peers]'" in stop.value.code
    assert started == []
    # Our own formats need no extra; the run gets what the command line chose.
    quant.main([*argv, "--formats", "float32", "ours int4 g128 (Hadamard + GPTQ)"])
    assert started == [["float32", "ours int4 g128 (Hadamard + GPTQ)"]]


def test_python_dash_m_runs_from_the_checkout_root():
    """As the README of benchmarks/ says to run them: the package and its peers subpackage."""
    for module in ("benchmarks.docs", "benchmarks.peers"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
