"""The compute ceiling of a trace: FLOP counts checked against torch's FLOP counter on the
transformers models, the peak GEMM measurement, and how the peers report uses them."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import roofline
from benchmarks.docs import render
from benchmarks.peers.compare import compute_summary, rows_and_ratios
from loraplex.engine.models.packing import cpu_can_prepack_bf16
from loraplex.engine.models.spec import spec_from_config
from tests.bench.test_reports import summary


@pytest.mark.parametrize("cap", [None, 1, 3, 7, 50])
def test_sum_min_matches_counting(cap):
    for lo in range(1, 12):
        for hi in range(lo - 1, 20):
            want = sum(min(c, cap) if cap else c for c in range(lo, hi + 1))
            assert roofline._sum_min(lo, hi, cap) == want, (lo, hi, cap)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "mistral"])
def test_request_flops_match_torch_flop_counter_on_transformers(kind, tiny_models):
    """Feed a request to the transformers model one token at a time, counting each step's
    FLOPs with torch's counter (eager attention over the KV cache): the sum is our count plus
    the lm_head rows of the prompt positions that sample nothing. The gemma3 model has a
    sliding window of 8 on alternate layers; 10 tokens cross it."""
    folder = tiny_models[kind]
    spec = spec_from_config(json.loads((folder / "config.json").read_text()))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    input_len, output_len = 6, 5
    fed = input_len + output_len - 1
    counted, cache = 0, None
    with torch.no_grad():
        for token in range(fed):
            counter = FlopCounterMode(display=False)
            with counter:
                out = model(torch.tensor([[10 + token]]), past_key_values=cache, use_cache=True)
            counted += counter.get_total_flops()
            cache = out.past_key_values
    extra_heads = roofline.head_flops(spec) * (fed - output_len)
    assert counted == roofline.request_flops(spec, input_len, output_len) + extra_heads
    # One token's pass, as a GPU roofline would count it: 2 x parameters of the layers.
    layer_params = sum(
        p.numel()
        for n, p in model.named_parameters()
        if ".layers." in n and p.dim() == 2  # the linears' weights; norms are vectors
    )
    assert roofline.linear_flops_per_token(spec) == 2 * layer_params


def test_flops_per_output_token_weights_requests_by_their_output(tiny_models):
    spec = spec_from_config(json.loads((tiny_models["llama"] / "config.json").read_text()))
    lengths = [(4, 1), (20, 9)]
    total = roofline.request_flops(spec, 4, 1) + roofline.request_flops(spec, 20, 9)
    assert roofline.flops_per_output_token(spec, lengths) == pytest.approx(total / 10)
    # A one-token answer costs its prompt and one head row: no token is fed back.
    assert roofline.request_flops(spec, 4, 1) == (
        4 * roofline.linear_flops_per_token(spec)
        + roofline.head_flops(spec)
        + roofline.attention_flops(spec, 1, 4)
    )
    with pytest.raises(ValueError, match="no output tokens"):
        roofline.flops_per_output_token(spec, [(5, 0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_peak_reports_the_fastest_form_and_restores_threads(tiny_models, dtype):
    spec = spec_from_config(json.loads((tiny_models["llama"] / "config.json").read_text()))
    before = torch.get_num_threads()
    peak = roofline.measure_peak(spec, dtype, threads=1, repeats=2, shapes=[(8, 64, 512)])
    assert torch.get_num_threads() == before
    forms = {f["form"] for f in peak["all"]}
    assert "F.linear" in forms
    if dtype == torch.bfloat16:
        assert ("oneDNN packed" in forms) == cpu_can_prepack_bf16()
        # the same products in float32 count too (a CPU without bf16 matmuls computes so)
        assert "float32 compute, F.linear" in forms
    else:
        assert not any(f.startswith("float32 compute") for f in forms)
    assert peak["gflops"] == max(f["gflops"] for f in peak["all"]) > 0
    assert peak["threads"] == 1 and peak["dtype"] == str(dtype).removeprefix("torch.")
    # Without explicit shapes, the model's lm_head and gate|up at serving batch sizes.
    assert (32, spec.hidden_size, spec.vocab_size) in roofline.gemm_shapes(spec)
    assert roofline.ceiling(200.0, 0.5e9) == pytest.approx(400.0)


def test_by_rows_keeps_the_fastest_form_per_batch_size(tiny_models, capsys):
    peak = {"all": [
        {"shape": [64, 8, 16], "form": "F.linear", "gflops": 3.0},
        {"shape": [8, 8, 16], "form": "F.linear", "gflops": 1.0},
        {"shape": [64, 8, 32], "form": "oneDNN packed", "gflops": 5.0},
        {"shape": [8, 8, 32], "form": "oneDNN packed", "gflops": 0.5},
    ]}  # fmt: skip
    best = roofline.by_rows(peak)
    assert list(best) == [8, 64]
    assert best[8]["gflops"] == 1.0 and best[64]["form"] == "oneDNN packed"
    # the command: every asked batch size against the peak, on a real model folder
    roofline.main(["--model", str(tiny_models["llama"]), "--dtype", "float32", "--threads", "1",
                   "--rows", "2,16", "--repeats", "1"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("peak: ") and "float32, 1 thread(s)" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["2", "16"]
    peak_gflops = float(lines[0].split()[1])
    for line in lines[1:]:
        rate = float(line.split()[2])
        assert 0 < rate <= peak_gflops
        assert f"= {rate / peak_gflops:4.0%} of the peak" in line


def test_compute_summary_and_docs_report_the_ceiling(tmp_path):
    runs = [
        {"system": "loraplex", "repeat": 0, "summary": summary(150, 10.0), "flops_per_token": 7e8},
        {"system": "hf", "repeat": 0, "summary": summary(20, 30.0), "flops_per_token": 6e8},
    ]
    rows, ratios = rows_and_ratios(runs, ["loraplex", "hf"], 1)
    peak = {"gflops": 200.0, "shape": [256, 640, 4096], "form": "oneDNN packed"}
    peak |= {"threads": 1, "dtype": "bfloat16", "all": []}
    c = compute_summary(runs, rows, peak)
    ours, hf = c["systems"]["loraplex"], c["systems"]["hf"]
    assert ours["gflops"] == pytest.approx(105.0) and ours["of_peak"] == pytest.approx(0.525)
    assert ours["ceiling_tok_s"] == pytest.approx(200e9 / 7e8)
    assert hf["gflops"] == pytest.approx(12.0)
    # 10 x HF's 20 tok/s against the ceiling of the trace loraplex served.
    assert c["hf_goal"]["needs_tok_s"] == pytest.approx(200.0)
    assert c["hf_goal"]["of_ceiling"] == pytest.approx(200.0 / (200e9 / 7e8))
    doc = {
        "kind": "peers",
        "model": "demo",
        "trace": {"description": "t"},
        "finished": "now",
        "settings": {},
        "runs": runs,
        "rows": rows,
        "ratios": ratios,
        "compute": c,
    }
    (tmp_path / "peers-demo.json").write_text(json.dumps(doc))
    page = render(tmp_path, tmp_path / "benchmarks.md")
    assert "the fastest GEMM measured in this run, 200 GFLOP/s" in page
    assert "loraplex 105.0 (52% of peak, ceiling 286 tok/s)" in page
    assert "×10 over HF+peft needs 200 output tok/s: 70% of the compute ceiling" in page


def test_the_cpu_attention_form_a_server_ran_is_read_from_its_own_start(tmp_path):
    """A peers run records the form the loraplex server's engine picked at its start: the
    last such line after where this start's lines begin (the log is appended to across runs),
    None when the start logged none."""
    from types import SimpleNamespace

    from benchmarks.peers.compare import cpu_attention_picked

    log = tmp_path / "loraplex-server.log"
    line = "2026-12-06 22:01:08,253 INFO [engine] CPU attention: {} (decode batch: ...)\n"
    log.write_text(line.format("sdpa"))
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("INFO [engine] loading\n" + line.format("matmul"))
    assert cpu_attention_picked(SimpleNamespace(log_path=log, log_start=start)) == "matmul"
    assert cpu_attention_picked(SimpleNamespace(log_path=log, log_start=0)) == "matmul"
    assert cpu_attention_picked(SimpleNamespace(log_path=log, log_start=log.stat().st_size)) is None
    missing = SimpleNamespace(log_path=tmp_path / "none.log", log_start=0)
    assert cpu_attention_picked(missing) is None
