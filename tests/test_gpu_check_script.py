"""scripts/gpu_check.sh without a GPU: its syntax, the dry-run plan against this checkout, and
its robustness in a scratch copy whose Python is a stand-in that passes, fails, hangs or
writes figures per part (a failing or timed-out part is recorded and the next one runs,
every part's exit code reaches the JSON, the budget skips what no longer fits)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils")

# The stand-in interpreter. argv[0] is this file; the real Python runs it.
FAKE_PYTHON = r"""#!{python}
import json, os, sys, time
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(args)[:120].replace("\n", " ") + "\n")
if args[0] == "-c" and "run_module" in args[1]:  # the launcher: the module and its args
    args = ["-m"] + args[2:]
if args[0] == "-c":
    if "cuda.is_available" in args[1]:
        sys.exit(0 if os.environ.get("FAKE_GPU", "1") == "1" else 1)
    print("torch fake, GPU fake")
elif args[0] == "-":  # a heredoc: the JSON merge runs for real, the LoRA-off engine is faked
    code = sys.stdin.read()
    if "parts_file" in code:
        sys.argv = ["merge"] + args[1:]
        exec(compile(code, "merge", "exec"), {"__name__": "__main__"})
    else:
        Path(args[1]).write_text(json.dumps({"decode_step_ms": 20.0, "batch": 64}))
elif args[0].endswith("serve_check.py"):  # the serve part: its script file, then its JSON
    assert "def main" in Path(args[0]).read_text()
    Path(args[1]).write_text(json.dumps({"ok": True, "device": f"{args[2]}:0 (fake)"}))
elif args[:2] == ["-m", "pytest"]:
    for a in args:
        if a.startswith("--junitxml="):
            Path(a.split("=", 1)[1]).write_text(
                '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" '
                'skipped="1"><testcase classname="tests.kernels.test_gpu" name="test_ok"/>'
                '<testcase classname="tests.engine.test_graphs" name="test_replay">'
                '<failure message="x"/></testcase><testcase classname="t" name="s">'
                '<skipped/></testcase></testsuite></testsuites>')
    print("1 failed, 1 passed, 1 skipped")
    sys.exit(1)
elif args[1].endswith("gpu_engine"):
    batch = int(args[args.index("--batch") + 1])
    eager = "--enforce-eager" in args
    if batch == 64 and eager:
        time.sleep(60)  # hangs: the part's limit must end it
    if batch == 32:
        sys.exit(3)
    base, lora = (25.0, 30.0) if batch == 64 else (10.0, 11.0)
    report = {"device": "NVIDIA H100 80GB HBM3", "batch": batch, "adapters": 32, "rank": 16,
              "shape": {"hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8},
              "decode_step_ms": {"base": base, "lora": lora},
              "lora_overhead": lora / base - 1, "roofline_fraction": 0.5}
    out = Path("benchmarks/results") / f"gpu-engine-b{batch}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report))
else:
    sys.exit(f"fake python: unexpected {args}")
"""


def run(script: Path, out: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), **env)
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_plans_every_part_against_this_checkout(tmp_path):
    proc = run(SCRIPT, tmp_path, {"GPU_CHECK_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [p["name"] for p in report["parts"]]
    assert names[:2] == ["env", "gpu_tests"] and "no_lora_b64" in names
    modes = len(report["engine_modes"])  # graphs and eager when gpu_engine has the switch
    engine = [n for n in names if n.startswith("engine_")]
    assert len(engine) == 3 * modes and engine[0].startswith("engine_b64_")
    assert all(p["status"] == "planned" and p["rc"] is None for p in report["parts"])
    assert report["dry_run"] == "1" and not report["all_passed"]
    gpu_tests = report["parts"][1]["command"]
    assert "-m pytest" in gpu_tests and "-m gpu" in gpu_tests
    # the planned engine module exists in this checkout
    command = next(p for p in report["parts"] if p["name"] == engine[0])["command"]
    module = command.split("alter_sys=True)")[1].split()[0]  # the launcher's first argument
    assert module.startswith(("benchmarks.", "bench.")), command
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()
    assert sum(p["limit_s"] for p in report["parts"][:3]) < report["budget_s"]
    assert (tmp_path / "gpu_check.log").read_text().count("plan: ") == len(names)


@pytest.fixture
def scratch(tmp_path):
    """A copy of the script in a folder laid out as the repository, with a stand-in Python and
    a stand-in gpu_engine.py that offers the eager switch."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_check.sh")
    (repo / "benchmarks" / "gpu_engine.py").write_text('ap.add_argument("--enforce-eager")\n')
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.replace("{python}", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.txt"
    env = {"PYTHON": str(fake), "FAKE_CALLS": str(calls), "PATH": os.environ["PATH"]}
    return repo / "scripts" / "gpu_check.sh", env, calls


def test_a_failing_or_hanging_part_is_recorded_and_the_rest_still_runs(scratch, tmp_path):
    script, env, calls = scratch
    out = tmp_path / "out"
    proc = run(script, out, dict(env, GPU_CHECK_LIMIT_ENGINE_B64_EAGER="2"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["env", "gpu_tests", "engine_b64_graphs", "engine_b64_eager",
                           "no_lora_b64", "serve", "engine_b32_graphs", "engine_b32_eager",
                           "engine_b1_graphs", "engine_b1_eager", "tensor_parallel",
                           "kernels_compiled"]  # fmt: skip
    status = {n: (p["rc"], p["status"]) for n, p in parts.items()}
    # the stand-in device has one GPU: the tensor-parallel part says so instead of running
    assert status["tensor_parallel"] == (None, "skipped")
    assert "needs 2 GPUs" in parts["tensor_parallel"]["command"]
    assert status["env"] == (0, "ok")
    assert status["gpu_tests"] == (1, "failed")
    assert status["engine_b64_eager"] == (124, "timed out")
    assert parts["engine_b64_eager"]["limit_s"] == 2 and parts["engine_b64_eager"]["seconds"] < 8
    assert status["engine_b32_graphs"] == (3, "failed")
    assert status["serve"] == (0, "ok") and parts["serve"]["result"]["device"] == "cuda:0 (fake)"
    assert status["engine_b1_eager"] == (0, "ok") and status["kernels_compiled"] == (1, "failed")
    assert "--enforce-eager" in parts["engine_b1_eager"]["command"]
    assert "--enforce-eager" not in parts["engine_b1_graphs"]["command"]
    assert not report["all_passed"]
    # the figures of the runs that finished, and what they say against the goals
    s = report["summary"]
    assert set(s) == {"b64_graphs", "b1_graphs", "b1_eager"}
    assert s["b64_graphs"]["base_ms"] == 25.0 and s["b64_graphs"]["roofline_fraction"] == 0.5
    assert s["b64_graphs"]["no_adapter_overhead"] == pytest.approx(25.0 / 20.0 - 1)
    # 32 adapters x 32 layers x r16 x (q 4096+4096, k/v 4096+1024, o 4096+4096) x 2 bytes
    extra = 32 * 32 * 16 * (8192 + 5120 + 5120 + 8192) * 2
    assert s["b64_graphs"]["adapter_bytes"] == extra
    assert s["b64_graphs"]["lora_cost_vs_bytes"] == pytest.approx(5.0 / (extra / 3.35e12 * 1e3))
    assert parts["gpu_tests"]["tests"] == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "failed": ["tests.engine.test_graphs::test_replay"],
    }
    assert "tests" not in parts["kernels_compiled"]  # no junit asked of that part
    log = (out / "gpu_check.log").read_text()
    assert "engine_b64_eager: timed out after 2s" in log and "FAILED:" in log
    assert sorted(p.name for p in out.iterdir()) == ["gpu-tests.xml", "gpu_check.json",
                                                     "gpu_check.log"]  # fmt: skip


def test_the_budget_skips_parts_that_no_longer_fit(scratch, tmp_path):
    script, env, calls = scratch
    out = tmp_path / "out"
    proc = run(script, out, dict(env, GPU_CHECK_BUDGET_S="25"))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # nothing ran, nothing failed
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["parts"] and {p["status"] for p in report["parts"]} == {"skipped"}
    assert "gpu_engine" not in calls.read_text()  # only the GPU probe and the merge ran


def test_no_cuda_python_exits_2_with_the_reason_in_the_json(scratch, tmp_path):
    script, env, calls = scratch
    out = tmp_path / "out"
    proc = run(script, out, dict(env, FAKE_GPU="0"))
    assert proc.returncode == 2
    report = json.loads((out / "gpu_check.json").read_text())
    assert [(p["name"], p["rc"]) for p in report["parts"]] == [("env", 2)]
    assert "no Python with a CUDA torch" in (out / "gpu_check.log").read_text()
