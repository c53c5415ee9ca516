"""The platform's hop over vLLM split by stage (issue 60, item 3), for benchmarks/dataplane.py.

While the hop's trace goes through `loraplex serve --data-plane vllm` once more (after the
counted runs, so that sampling slows none of them), py-spy samples the platform process's
thread that holds the GIL (its Python at work, not a thread blocked on a socket or the disk)
and each sample is put in one stage by its stack: from the innermost frame outwards, the
first frame that names a stage's code decides (a database call made while checking the key
is auth, the same call made while recording usage is metering). The process's own CPU time
over the run (/proc, all its threads) gives the total; the stages share it in proportion to
their samples (C code that runs with the GIL released, SQLite's or a socket's, is counted
only in the total). A CPU millisecond of the platform is one vLLM could not use where both
share the cores, as on the benchmark's machine; the latency the hop adds is in the hop's
table.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# (stage, marks): a mark is a substring of a py-spy frame "function (path:line)", or several
# joined by "&" that must all be in it; a sample goes to the stage of its innermost frame
# that carries any of a stage's marks (the stages tried in this order for each frame).
# fmt: off
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("poller (vLLM's health, models, metrics; each second)", ("_poll_loop (", "poll_once (",
                                                               "._poll (&/dataplane/vllm.py",
                                                               "metrics_of (")),
    ("auth (API key)", ("current_caller (", "authenticate (", "/security.py", "/api/deps.py")),
    ("quota and adapter look-up", ("resolve_model (", "_version_row (", "/quotas.py",
                                   "_charge (&/serving.py", "touch_adapter_used (",
                                   "/adapter_refs.py", "/store/")),
    ("routing and fair-share admission", ("_route (&/dataplane/", "/dataplane/fairshare.py",
                                          "/dataplane/agent.py")),
    ("upstream call (the request to vLLM, its stream read and parsed)",
     ("/dataplane/vllm.py", "/dataplane/protocol.py", "/aiohttp/", "/yarl/", "/multidict/")),
    ("metering (usage record, ledger, metrics)", ("/usage.py", "/ledger.py", "/journal.py",
                                                  "/bill_on_send.py", "finish (&/serving.py",
                                                  "/platform/metrics.py", "/prometheus_client/")),
    ("SSE re-encoding (the client's chunks)", ("/platform/openai/",)),
    ("request start (body, prompt, job)", ("/platform/serving.py", "/engine/tokenizer",
                                           "/tokenizers/")),
    ("HTTP server (uvicorn, starlette, fastapi: requests parsed, the socket written)",
     ("/uvicorn/", "/starlette/", "/fastapi/", "/h11/", "/httptools/", "Transport.write (")),
]
# fmt: on
LOOP = "event loop (asyncio's own)"
OTHER = "other"
# Innermost frames of a thread that waits (the event loop in select, a pool thread for work,
# a lock): not counted. A database call waiting on the disk is counted, in its stage.
IDLE = ("select (", "Condition.wait (", "Event.wait (", "_worker (&/concurrent/futures/",
        "SimpleQueue.get (", "sleep (")  # fmt: skip


def marked(frame: str, marks: tuple[str, ...]) -> bool:
    return any(all(part in frame for part in m.split("&")) for m in marks)


def stage_of(frames: list[str]) -> str:
    """The stage of one sample (frames outermost first)."""
    for frame in reversed(frames):
        for stage, marks in STAGES:
            if marked(frame, marks):
                return stage
        if marked(frame, ("Handle._run (", "BaseEventLoop._run_once (")):
            return LOOP  # what a callback or the loop did, in asyncio's own code
    return OTHER


def split_samples(raw: str) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Samples per stage in py-spy's raw output (`frame;frame;... count` per line), and per
    stage the samples by innermost frame (what to read when a stage is larger than thought)."""
    counts: dict[str, int] = {}
    leaves: dict[str, dict[str, int]] = {}
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if n.isdigit() and stack and not marked(frames[-1], IDLE):
            stage = stage_of(frames)
            counts[stage] = counts.get(stage, 0) + int(n)
            by_leaf = leaves.setdefault(stage, {})
            by_leaf[frames[-1]] = by_leaf.get(frames[-1], 0) + int(n)
    return counts, leaves


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_stages(pid: int, run: Callable[[], dict], requests: int, tokens: int,
                  rate: int = 200) -> dict:  # fmt: skip
    """Run `run()` (one pass of the trace through the platform, `requests` requests giving
    `tokens` output tokens) while py-spy samples process `pid`: the platform's CPU time per
    request and per token, and its split by stage."""
    local = Path(sys.executable).with_name("py-spy")
    exe = str(local) if local.exists() else shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    with tempfile.TemporaryDirectory(prefix="dataplane-spy-") as tmp:
        out = Path(tmp) / "samples.txt"
        # --nonblocking: the platform is not paused to read a sample (it would slow the hop
        # it measures); a torn stack now and then lands in "other". --gil: only the thread
        # running Python counts, not one blocked in a socket read or a disk write.
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking", "--gil",
               "--full-filenames", "--format", "raw", "--output", str(out),
               "--duration", "600"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        time.sleep(1.0)  # attached by then
        cpu0, t0 = cpu_s(pid), time.perf_counter()
        result = run()
        cpu, wall = cpu_s(pid) - cpu0, time.perf_counter() - t0
        proc.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"error": "py-spy did not exit"}
        if not out.exists():
            return {"error": "py-spy wrote nothing: " + (err or "").strip()[-300:]}
        counts, leaves = split_samples(out.read_text())
    total = sum(counts.values()) or 1
    per_request_ms = cpu * 1e3 / requests
    stages = {
        stage: {
            "share": n / total,
            "cpu_ms_per_request": per_request_ms * n / total,
            "top_frames": dict(sorted(leaves[stage].items(), key=lambda kv: -kv[1])[:8]),
        }
        for stage, n in sorted(counts.items(), key=lambda kv: -kv[1])
    }
    return {"run": result, "wall_s": wall, "cpu_s": cpu, "samples": sum(counts.values()),
            "rate": rate, "cpu_ms_per_request": per_request_ms,
            "cpu_us_per_token": cpu * 1e6 / max(tokens, 1), "stages": stages}  # fmt: skip


def table(split: dict) -> str:
    """The split as a markdown table (what docs/fleet.md shows)."""
    if "error" in split:
        return f"(no split: {split['error']})"
    rows = ["| stage | share of the platform's CPU | CPU ms per request |", "| --- | ---: | ---: |"]
    for stage, s in split["stages"].items():
        rows.append(f"| {stage} | {s['share']:.0%} | {s['cpu_ms_per_request']:.2f} |")
    rows.append(f"| all | 100% | {split['cpu_ms_per_request']:.2f} |")
    return "\n".join(rows)
