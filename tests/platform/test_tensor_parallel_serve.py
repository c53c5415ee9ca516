"""A tensor-parallel rank killed under `loraplex serve --tensor-parallel-size 2`: the server
treats it as the engine dying (tests/platform/test_faults.py): the stream in flight ends with
an error event, billed exactly what its client received; `serve` exits non-zero with every
process of the group gone (rank 0's engine process and its workers: nothing leaks); and the
`serve` the orchestrator starts in its place, on the same data dir, forms a new group and
answers. A rank killed while the engine is idle is seen without a request (the engine
process watches its ranks while it waits for commands): `serve` exits non-zero alike."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.platform.test_faults import _engine_child, _stream
from tests.platform.test_quickstart import Serve, _usage_rows


def _children(pid: int, marker: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not: it only waits to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _serve(data_dir: Path, model: Path) -> Serve:
    return Serve(data_dir, "--model", str(model), "--tensor-parallel-size", "2",
                 env={"LORAPLEX_MAX_MODEL_LEN": "512"})  # fmt: skip


@pytest.mark.slow  # two TP = 2 servers start, one after the other
def test_a_killed_rank_ends_streams_billed_and_serve_restarts_the_group(tiny_models, tmp_path):
    serve = _serve(tmp_path, tiny_models["llama"])
    try:
        serve.wait_ready()
        key = serve.key()
        engine = _engine_child(serve.proc.pid)
        workers = _children(engine, b"loraplex.engine.parallel.worker")
        assert len(workers) == 1, workers  # rank 1; rank 0 is the engine process itself
        killed: list[bool] = []

        def kill_rank_1(received: int) -> None:
            if not killed and received >= 3:
                os.kill(workers[0], signal.SIGKILL)
                killed.append(True)

        events, received = _stream(serve.url, key, "llama", kill_rank_1)
        assert killed and received < 200
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable", error
        assert serve.proc.wait(60) == 3
        logs = serve.logs()
        assert "loraplex: error: the engine stopped" in logs, logs[-3000:]
        assert "tensor-parallel rank failed" in logs, logs[-3000:]
        # nothing of the group outlives the server
        assert not [p for p in [engine, *workers] if _running(p)]
    finally:
        serve.close()
    rows = _usage_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["status"] == "error"
    assert rows[0]["completion_tokens"] == received

    # the orchestrator's restart: a new group on the same data dir serves the same tenant
    again = _serve(tmp_path, tiny_models["llama"])
    try:
        again.wait_ready()
        engine = _engine_child(again.proc.pid)
        workers = _children(engine, b"loraplex.engine.parallel.worker")
        assert len(workers) == 1, workers
        reply = httpx.post(f"{again.url}/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "llama", "prompt": "hi", "max_tokens": 4,
                                 "ignore_eos": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        # a rank killed while nothing runs: seen without a request, and the server exits
        os.kill(workers[0], signal.SIGKILL)
        assert again.proc.wait(60) == 3
        assert not [p for p in [engine, *workers] if _running(p)]
    finally:
        again.close()
    rows = _usage_rows(tmp_path)
    assert [r["status"] for r in rows] == ["error", "ok"]
