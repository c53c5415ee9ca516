"""`python -m benchmarks.long_outputs` at a small size: both sides generate every token, and
the engine -> server step messages stay flat in size as the outputs grow (only what changed
goes out)."""

from __future__ import annotations

import argparse
import json

from benchmarks import long_outputs


def test_bench_long_smoke(tmp_path, capsys):
    p = argparse.ArgumentParser()
    long_outputs.add_args(p)
    out = tmp_path / "long.json"
    args = p.parse_args(["--tokens", "160", "--concurrency", "2", "--early", "10",
                         "--late", "150", "--out", str(out)])  # fmt: skip
    doc = long_outputs.run_long(args)
    (row,) = doc["rows"]
    assert row["requests"] == 2 and row["tokens"] == 160
    # A step message carries two requests' new token, text and finish fields: tens of bytes
    # each, the same at token 150 as at token 10 (whole outputs would be ~10x by then).
    assert 0 < row["bytes_early"] < 2000 and row["bytes_ratio"] <= 1.2
    assert row["served_tok_s"] > 0 and row["offline_tok_s"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    printed = capsys.readouterr().out
    assert "ratio late/early" in printed and "ratio served/offline" in printed
