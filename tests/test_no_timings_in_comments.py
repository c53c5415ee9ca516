"""Comments say why, never how fast on which CPU: no timing in engine/, kernels/, platform/.

A figure measured on one machine goes stale the day the code or the machine changes; it belongs
in docs/benchmarks.md ("Measurements behind choices in the code", benchmarks/docs.py) with the
command that measures it again. This scans every comment and docstring (found with `tokenize`,
so code and ordinary strings are left alone) for a number followed by a time or rate unit, or a
speed-up factor, and names each hit file:line.

What counts as a figure: "17 ms", "15 us", "0.73 -> 0.60 ms", "53 tok/s", "33 -> 42 GFLOP/s",
"~2.3x faster", "x5 slower", "10-15 % of its speed", "1.2 s per step". What does not: a unit
with no number ("timeout in seconds", "per COALESCE_S"), and a plain duration in seconds ("at
least every 2 s", "30 s of waiting"): that is how settings state their values, not a
measurement. A comment that must state a setting's value in a sub-second unit goes in ALLOWED.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "kernels", "platform")

_NUM = r"(?<![\w.])[~≈]?\d+(?:[.,]\d+)?"
_RANGE = r"(?:\s*(?:-|–|→|->|to|vs\.?)\s*[~≈]?\d+(?:[.,]\d+)?)?"
_TIME = r"(?:ms|msec|µs|us|usec|ns|s per|s an?|s each|seconds? per|tok/s|tokens?/s|req/s)"
_RATE = r"(?:[GT]FLOP/s|[GMT]B/s)"
FIGURE = re.compile(
    rf"{_NUM}{_RANGE}\s*(?:{_TIME}|{_RATE})(?![\w/])"
    rf"|{_NUM}\s*[x×]\s*(?:faster|slower|speed-?up|fewer|more throughput)"
    rf"|(?<!\w)[x×]\s*\d+(?:\.\d+)?\s*(?:faster|slower)"
    rf"|{_NUM}{_RANGE}\s*%\s*(?:faster|slower|of (?:its|the|a|each)\s+\w*\s*(?:speed|time|step))",
    re.IGNORECASE,
)

# (path relative to the root, a substring of the line): comments that state a setting's value.
ALLOWED: set[tuple[str, str]] = set()


def comment_lines(source: str):
    """(line number, text) of every comment and docstring line in `source`."""
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and prev in (
            tokenize.NEWLINE,
            tokenize.NL,
            tokenize.INDENT,
            tokenize.DEDENT,
        ):  # a string that is a statement of its own: a docstring
            for i, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, line
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type


def figures(source: str, name: str = "") -> list[str]:
    hits = []
    for line_no, text in comment_lines(source):
        for m in FIGURE.finditer(text):
            if any(name == path and part in text for path, part in ALLOWED):
                continue
            hits.append(f"{name}:{line_no}: {m.group(0)!r} in {text.strip()!r}")
    return hits


def _files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_timing_in_comments_or_docstrings():
    hits = []
    for path in _files():
        hits += figures(path.read_text(), str(path.relative_to(ROOT)))
    assert not hits, (
        "timings in comments (move the figure to CODE_FIGURES in benchmarks/docs.py, with the "
        "command that measures it, and say why in the comment):\n" + "\n".join(hits)
    )


@pytest.mark.parametrize(
    "text",
    [
        "# Upcasting every row cost 17 ms per step at Gemma's 262k vocabulary",
        "# The op wants bf16 anyway; a float32 rotation is faster (M = 1: 15 us vs 26 us)",
        "# [37, 640] x [640, 4096] 0.73 -> 0.60 ms, one row 0.22 -> 0.11 ms",
        "# 33 -> 42 GFLOP/s, the demo model served in-process 53 -> 59.5 tok/s",
        "# index_select copies whole blocks (~2.3x faster than advanced indexing)",
        "# on a tiny model (1 ms steps) the wake-ups cost the engine 10-15 % of its speed",
        "# emulated bf16 is ×7 slower",
        "# 1.2 s per step with 2 threads",
        "# a fill costs 40 µs a row",
        '"""Keys are hashed once: one indexed lookup instead of ~100 ms of CPU."""',
    ],
)
def test_the_old_comments_are_caught(text):
    assert figures(f"{text}\nx = 1\n"), text


@pytest.mark.parametrize(
    "text",
    [
        "# Renewed every third of the lease, and at least every 2 s: the beat is also how",
        "# 30 s of waiting out another writer beats failing at once",
        "# timeout in seconds; None waits forever",
        "# at most this often while busy (STATS_EVERY_S)",
        "# the demo model's [262144, 640] head, 64 rows, rank 16, 8 heads / 2 KV heads",
        "# several times faster than a float matmul there",
        "# steps over COALESCE_S are unaffected; 10 % of the layer's flops",
        "# uses 4 bits per weight, the vocabulary is 32k, bf16 x 2 for the KV",
    ],
)
def test_settings_and_shapes_are_not_timings(text):
    assert not figures(f"{text}\nx = 1\n"), text


def test_code_and_plain_strings_are_not_scanned():
    source = 'LIMIT = "17 ms"  # the limit\nprint("2.3x faster")\n'
    assert not figures(source)


def test_the_files_before_the_timings_moved_out_fail():
    """The docstrings and comments as they were before issue 37, kept here verbatim in part."""
    old = '''
def compute_logits(self, hidden):
    """hidden [rows, hidden] -> logits [rows, vocab]; only rows that sample.

    needs float32, and a greedy argmax is exact in any dtype. Upcasting every row cost
    17 ms per step at Gemma's 262k vocabulary and 32 rows (bf16, CPU).
    """
    # (~2.3x faster than advanced indexing on the CPU). With a scale: dequantized to dtype.
    return hidden
'''
    hits = figures(old, "engine/models/decoder.py")
    assert [h.split(": ")[0] for h in hits] == [
        "engine/models/decoder.py:6",
        "engine/models/decoder.py:8",
    ]
