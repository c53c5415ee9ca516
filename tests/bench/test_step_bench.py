"""benchmarks/step.py's pieces: view-op classification, op counting, the baseline tree from
`git archive` imported through the shim (and not from this checkout), a worker subprocess
on a 2-layer model (a real profiler trace), and the table and page it makes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from benchmarks import step

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "-C", str(step.REPO), "rev-parse", "HEAD"],
                   capture_output=True).returncode != 0,
    reason="needs the checkout's git history",
)  # fmt: skip


def test_view_ops_are_told_from_ops_that_compute():
    for name in ("aten::view", "aten::transpose", "aten::select", "aten::slice", "aten::t",
                 "aten::expand", "aten::unsqueeze", "aten::as_strided"):  # fmt: skip
        assert step.is_view_op(name), name
    for name in ("aten::add", "aten::mm", "aten::copy_", "aten::index_select", "aten::empty",
                 "aten::clone", "not_an_op", "aten::no_such_op"):  # fmt: skip
        assert not step.is_view_op(name), name


@dataclass
class Event:  # the fields of torch.profiler's FunctionEvent that count_ops and time_split read
    name: str
    cpu_parent: Event | None = None
    self_cpu_time_total: float = 0.0  # us


def test_time_split_sums_aten_self_time_per_step_and_ranks_ops():
    events = [
        Event("ProfilerStep#1", self_cpu_time_total=900.0),  # not an aten op
        Event("aten::bmm", self_cpu_time_total=3000.0),
        Event("aten::bmm", self_cpu_time_total=1000.0),
        Event("aten::view", self_cpu_time_total=200.0),
        Event("aten::mm", self_cpu_time_total=2000.0),
    ]
    split = step.time_split(events, steps=2, top=2)
    assert split["aten_ms"] == pytest.approx(3.1)  # 6,200 us over two steps
    assert split["top"] == [("aten::bmm", pytest.approx(2.0)), ("aten::mm", pytest.approx(1.0))]


def test_count_ops_counts_nested_views_and_top_level():
    step_fn = Event("ProfilerStep#1")
    linear = Event("aten::linear", step_fn)
    events = [
        step_fn,
        Event("aten::view", step_fn),  # top-level view
        linear,
        Event("aten::t", linear),  # nested view
        Event("aten::addmm", linear),  # nested op
        Event("aten::add", Event("some_python_function", step_fn)),  # top-level under Python
        Event("cudaLaunchKernel", linear),  # not an aten op
    ]
    assert step.count_ops(events) == {"aten": 5, "aten_no_view": 3, "aten_top": 3}


def test_package_dirs_read_the_trees_own_layout():
    dirs = step.package_dirs(step.REPO)
    assert dirs["engine"] == "engine" and dirs["kernels"] == "kernels"
    assert "platform" in dirs and all("." not in k for k in dirs)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return step.build_assets(2, 1, 4, cache=tmp_path_factory.mktemp("step-cache"))


def test_baseline_tree_is_imported_from_its_archive_not_this_checkout(assets, tmp_path):
    model, adapters = assets
    commit = step.resolve_commit("HEAD")
    with step.source_tree(commit) as root:
        assert (root / "engine" / "llm_engine.py").is_file()
        shim = step.make_shim(root, tmp_path / "shim")
        cfg = dict(root=str(root), model=str(model), batch=3, adapters=1,
                   adapter_paths=[str(p) for p in adapters], rank=4, prompt_len=4, warmup=1,
                   repeats=2, steps=2, profile_steps=1, cpu_attention="sdpa",
                   floor=True, sample_steps=50, sample_rate=200)  # fmt: skip
        res = good = step.run_worker(cfg, shim, timeout=120)
        assert "error" not in res, res.get("error")
        assert res["imported_from"].startswith(str(root.resolve()))
        assert not res["imported_from"].startswith(str(step.REPO / "engine"))
        assert res["torch_threads"] == 1
        assert len(res["ms_rounds"]) == 2 and res["ms_per_step"] > 0
        assert 0 < res["cpu_ms_per_step"] <= 1.5 * max(res["ms_rounds"])  # one busy thread
        ops = res["ops_per_step"]
        # a 2-layer decode step with LoRA: hundreds of aten ops, some of them views
        assert ops["aten"] > ops["aten_no_view"] > 50 and ops["aten"] >= ops["aten_top"] > 0
        # the kernel floor at the timed steps' middle context: prompt 4, its token, 1 + 4 / 2
        assert res["floor"]["context"] == 8 and 0 < res["floor"]["floor_ms"] < res["ms_per_step"]
        # py-spy (installed with the test extras) sampled the worker's own steps
        sampled = res["sampled"]
        assert "error" not in sampled, sampled
        assert sampled["samples"] > 0 and sum(sampled["shares"].values()) == pytest.approx(1)
        assert sampled["shares"]["kernels"] > 0  # a step's matmuls are kernels, whatever else
    assert not root.exists()  # the archive's folder is removed after the run

    # A worker pointed at a tree it does not import from refuses to report.
    bad = dict(cfg, root=str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    res = step.run_worker(bad, step.make_shim(step.REPO, tmp_path / "shim2"), timeout=120)
    assert "imported loraplex.engine from" in res["error"]

    # The table and the page from those figures (the current side failed).
    results = [{"batch": 3, "adapters": 1, "baseline": good, "current": {"error": "exit 1"}}]
    text = step.table(results)
    cells = f"| 3 | 1 | {good['ms_per_step']:.1f} | — | — | {good['cpu_ms_per_step']:.1f} | — | — |"
    assert cells + f" {ops['aten']:.0f} | — | — | {ops['aten_no_view']:.0f} | — | — |" in text
    report = {"command": "python -m benchmarks.step", "cpu": step.cpu_line(), "torch": "x",
              "python": sys.version.split()[0], "date": "today",
              "trees": [{"label": "baseline", "commit": commit[:9]}],
              "args": dict(warmup=1, repeats=2, steps=2, profile_steps=1, prompt_len=4,
                           layers=2, cpu_attention="sdpa")}  # fmt: skip
    step.write_doc(report, results, None, tmp_path / "page.md")
    page = (tmp_path / "page.md").read_text()
    assert commit[:9] in page and text in page and root.name in page


def test_a_tiny_llama_page_names_its_model_and_dtype(assets, tmp_path, monkeypatch):
    """`--model tiny-llama`: the page and figure say which model and dtype ran (from the
    folder's config.json), and leave out the skinny model's target line; the floor's products
    try every form the engine may run, float32 ones too for a bf16 model."""
    import torch

    model, _ = assets
    config = step.model_config(model)
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == step.SKINNY["hidden_size"]
    args = dict(warmup=1, repeats=2, steps=2, profile_steps=1, prompt_len=4, layers=32,
                cpu_attention="sdpa", model="tiny-llama", dtype="bfloat16", rank=8)  # fmt: skip
    report = {"command": "python -m benchmarks.step --model tiny-llama", "cpu": "x",
              "torch": "x", "python": "3", "date": "today", "model": config,
              "trees": [{"label": "current", "commit": "abc"}], "args": args}  # fmt: skip
    step.write_doc(report, [], None, tmp_path / "page.md")
    page = (tmp_path / "page.md").read_text()
    assert "tiny Llama (2 layers," in page and "bfloat16" in page and "rank 8" in page
    assert "Issue 36 asks" not in page and "32 layers" not in page
    assert step.model_line(report).startswith("tiny-llama (bfloat16)")
    skinny = dict(report, args=dict(args, model="skinny", dtype="float32"))
    step.write_doc(skinny, [], None, tmp_path / "skinny.md")
    assert "Issue 36 asks" in (tmp_path / "skinny.md").read_text()
    assert step.model_line(skinny).startswith("skinny 32-layer Llama")

    seen = []
    from benchmarks import roofline

    real = roofline._forms
    monkeypatch.setattr(roofline, "_forms", lambda w: seen.append(w.dtype) or real(w))
    x, w = torch.randn(4, 16).to(torch.bfloat16), torch.randn(8, 16).to(torch.bfloat16)
    assert step._product_ms(x, w) > 0
    assert seen == [torch.bfloat16, torch.float32]
    seen.clear()
    step._product_ms(x.float(), w.float())
    assert seen == [torch.float32]


def test_kernel_floor_sums_its_parts_and_counts_only_the_adapters_rows_use(assets):
    """The floor: layers x (fastest attention form + the four products) + the LM head + the
    used adapters' PEFT bytes at the measured bandwidth; the adapters' bytes are what their
    files hold (no slot stack zeros), and a batch of one row reads one adapter however many
    the engine holds."""
    import json

    import torch
    from safetensors.torch import load_file

    from loraplex.engine.models.spec import spec_from_config

    model, adapters = assets
    spec = spec_from_config(json.loads((model / "config.json").read_text()))
    paths = [str(p) for p in adapters] * 2  # two adapters' rows (the same files twice)
    fl = step.kernel_floor(spec, 4, paths, 20, torch.float32, 20.0)
    per_adapter = sum(
        t.numel() for t in load_file(adapters[0] / "adapter_model.safetensors").values()
    )
    assert fl["lora_bytes"] == 2 * per_adapter * 4
    assert fl["lora_read_ms"] == pytest.approx(fl["lora_bytes"] / fl["read_gbps"] / 1e6)
    assert set(fl["attention_ms_per_layer"]) == {"sdpa", "sdpa, masked", "matmul"}
    per_layer = min(fl["attention_ms_per_layer"].values()) + fl["linears_ms_per_layer"]
    assert fl["floor_ms"] == pytest.approx(
        spec.num_layers * per_layer + fl["head_ms"] + fl["lora_read_ms"]
    )
    assert (
        step.kernel_floor(spec, 1, paths, 20, torch.float32, 20.0)["lora_bytes"] == per_adapter * 4
    )
    assert step.kernel_floor(spec, 4, [], 20, torch.float32, 20.0)["lora_read_ms"] == 0

    base = {"ms_per_step": 4 * fl["floor_ms"]}
    results = [{"batch": 4, "adapters": 2, "baseline": base,
                "current": {"ms_per_step": 2 * fl["floor_ms"], "floor": fl}}]  # fmt: skip
    text = step.floor_section(results)
    assert f"| {fl['floor_ms']:.1f} | {base['ms_per_step']:.1f} | 0.25 | 2.00 |" in text
    assert "the floor is 0.25 of the baseline's step, so these kernels leave room" in text
    results[0]["baseline"] = {"ms_per_step": 2 * fl["floor_ms"]}
    assert "0.50 of the baseline's step, so no step" in step.floor_section(results)
    assert step.floor_section([{"batch": 1, "adapters": 0, "current": {"error": "x"}}]) == ""


def test_py_spy_samples_are_split_into_kernels_dispatch_and_python():
    step_frames = "<module> (bench.py:3);LLMEngine.step (engine/llm_engine.py:396);fwd (x.py:9)"
    raw = "\n".join(
        [
            # a kernel under torch's dispatch under the engine's Python
            f"{step_frames};THPVariable_bmm (libtorch_python.so);"
            "at::native::bmm_out_cpu (libtorch_cpu.so);mkl_blas_sgemm (libtorch_cpu.so) 7",
            # argument parsing: native, but no kernel below the Python frame
            f"{step_frames};torch::FunctionSignature::parse (libtorch_python.so) 2",
            # the interpreter itself
            f"{step_frames} 3",
            f"{step_frames};_PyEval_EvalFrameDefault (libpython3.11.so.1.0) 1",
            # a kernel frame above the innermost Python frame does not make it a kernel sample
            "at::native::foo (libtorch_cpu.so);LLMEngine.step (engine/llm_engine.py:1);"
            "g (y.py:2);c10::Dispatcher::call (libtorch_cpu.so) 4",
            # outside LLMEngine.step (an idle thread, the benchmark's loop): not counted
            "_worker (concurrent/futures/thread.py:81);"
            "PyThread_acquire_lock_timed (libpython.so) 50",
            "<module> (bench.py:3);at::native::add (libtorch_cpu.so) 9",
            "",
        ]
    )
    assert step.split_samples(raw) == {"kernels": 7, "dispatch": 6, "python": 4}
