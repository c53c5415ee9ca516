"""`python -m benchmarks.serving_overhead` at a tiny size: every side generates every token,
the table has its columns, and each stage's share of a token is a real, non-negative figure."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from benchmarks import serving_overhead as so


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    so.add_args(p)
    return p.parse_args(["--long", "2,12", "--short", "4,4", "--max-num-seqs", "2",
                         "--out", str(tmp_path / "so.json"), "--md", str(tmp_path / "so.md"),
                         *extra])  # fmt: skip


def test_bench_serving_overhead_smoke(tmp_path, capsys):
    doc = so.run(_args(tmp_path, "--no-served"))
    assert set(doc["cases"]) == {"long", "short"}
    # every side runs the server's engine options, not EngineConfig's (first-come, 4 slots)
    assert doc["engine_options"]["scheduling_policy"] == "vtc"
    assert doc["engine_options"]["max_loras"] == 8
    for case in doc["cases"].values():
        assert set(case["sides"]) == {"offline", "engine process"}
        for side in case["sides"].values():
            assert side["tok_s"] > 0 and side["over_offline"] > 0
        split = case["split_us_per_token"]
        assert set(split) == set(so.STAGES)
        assert all(v >= 0 for v in split.values()) and split["forward"] > 0
    assert json.loads((tmp_path / "so.json").read_text()) == json.loads(json.dumps(doc))
    table = (tmp_path / "so.md").read_text()
    assert table in capsys.readouterr().out
    assert "| case | side | tok/s | / offline |" in table
    assert "| long | " in table and "| short | " in table


def test_table_has_a_row_per_side_and_a_column_per_stage():
    side = {"tok_s": 90.0, "over_offline": 0.9, "server_cpu_per_1k": 0.2,
            "engine_cpu_per_1k": 1.5}  # fmt: skip
    case = {"requests": 8, "tokens": 3072,
            "sides": {s: dict(side) for s in so.SIDES},
            "split_us_per_token": dict.fromkeys(so.STAGES, 1.0)}  # fmt: skip
    table = so.markdown({"cases": {"long": case}})
    rows = [ln for ln in table.splitlines() if ln.startswith("| long: 8 x 3,072 |")]
    assert [r.split(" | ")[1] for r in rows] == list(so.SIDES)
    assert rows[0].endswith("| 90.0 | 0.90 | 200.0 | 1,500.0 |")
    header = next(ln for ln in table.splitlines() if "µs/tok" in ln)
    assert all(f"{s} µs/tok" in header for s in so.STAGES)


def test_delta_codec_compares_two_revisions_on_the_same_outputs(capsys):
    from benchmarks import delta_codec

    head = subprocess.run(["git", "-C", str(delta_codec.REPO), "rev-parse", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    if head.returncode != 0:
        pytest.skip("needs the checkout's git history")
    p = argparse.ArgumentParser()
    delta_codec.add_args(p)
    args = p.parse_args(["--against", head.stdout.strip(), "--requests", "2", "--tokens", "8",
                         "--repeats", "2"])  # fmt: skip
    doc = delta_codec.run(args)  # asserts both rebuild the same outputs
    assert len(doc) == 2
    for figures in doc.values():
        assert figures["bytes_per_step"] > 0 and figures["encode_us_per_token"] >= 0
    assert "bytes per step message" in capsys.readouterr().out


def test_ledger_arms_table_both_ways_of_writing():
    table = so.ledger(entries=16, threads=4)
    rows = [r for r in table.splitlines() if r.startswith("| one") or r.startswith("| grouped")]
    assert [r.split(" |")[0] for r in rows] == ["| one transaction each", "| grouped"] * 2
    assert all(float(r.split("|")[2].replace(",", "")) > 0 for r in rows)


def test_a_case_of_no_requests_is_left_out(tmp_path):
    args = _args(tmp_path, "--long", "0,0")
    assert set(so._cases(args)) == {"short"}
