"""An engine that cannot start or dies while serving: the server says so at once, ends
in-flight requests cleanly, bills what was sent, and `serve` exits non-zero so that the
orchestrator restarts it (never a zombie answering "loading" for ever)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from tests.platform.test_quickstart import BIN, Serve, _usage_rows
from tests.utils.server import run_server


def _engine_child(pid: int) -> int:
    """The pid of the engine process `serve` spawned (multiprocessing's spawn_main child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine child of {pid}")


def _stream(url: str, key: str, model: str, on_tokens) -> tuple[list[str], int]:
    """Stream a long completion; `on_tokens(received)` runs after each chunk."""
    body = {"model": model, "prompt": "The quick brown", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}  # fmt: skip
    events, received = [], 0
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if events[-1] == "[DONE]":
                break
            chunk = json.loads(events[-1])
            if chunk.get("choices") and chunk["choices"][0]["logprobs"]:
                received += len(chunk["choices"][0]["logprobs"]["tokens"])
            on_tokens(received)
    return events, received


def _serve_too_long(model: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`serve` asked for a context longer than the model's position table: cannot start."""
    return subprocess.run(
        [str(BIN / "loraplex"), "serve", "--model", str(model), "--max-model-len", "100000",
         "--port", "0", *args],
        env={**os.environ, "LORAPLEX_DATA_DIR": str(data_dir)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_serve_exits_at_once_with_one_line_when_the_engine_cannot_start(tiny_models, tmp_path):
    start = time.monotonic()
    proc = _serve_too_long(tiny_models["llama"], tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert elapsed < 30
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loraplex: error: the engine could not start"), last
    assert "max_model_len 100000 exceeds" in last
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_debug_log_level_adds_the_traceback(tiny_models, tmp_path):
    proc = _serve_too_long(tiny_models["llama"], tmp_path, "--log-level", "debug")
    assert proc.returncode == 3
    assert "Traceback" in proc.stderr and "in __post_init__" in proc.stderr


def test_a_killed_engine_ends_streams_cleanly_and_flips_readiness(tiny_models, tmp_path):
    """In-process server (no exit callback): SIGKILL the engine process mid-stream."""
    with run_server(tiny_models["llama"], tmp_path) as srv:
        _, key = srv.new_tenant("acme")
        killed_at: list[float] = []

        def kill_after_three(received: int) -> None:
            if not killed_at and received >= 3:
                os.kill(srv.state.engine._proc.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        events, received = _stream(srv.url, key, "llama", kill_after_three)
        assert killed_at and received < 200
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["type"]
        # Readiness and liveness fail within 2 s, naming the cause.
        deadline = killed_at[0] + 2
        while httpx.get(f"{srv.url}/readyz").status_code != 503:
            assert time.monotonic() < deadline, "readyz still 200 two seconds after the kill"
            time.sleep(0.05)
        ready = httpx.get(f"{srv.url}/readyz")
        assert "engine stopped" in ready.json()["error"]
        assert httpx.get(f"{srv.url}/healthz").status_code == 503
        # New requests: a clean 503 with OpenAI's error body, not a 500.
        after = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "llama", "prompt": "hi", "max_tokens": 2})  # fmt: skip
        assert after.status_code == 503
        assert after.json()["error"]["code"] == "engine_unavailable"
        with srv.sessions() as session:
            rows = session.scalars(select(UsageRecord).order_by(UsageRecord.id)).all()
        # The stream is billed exactly what its client received.
        assert rows[0].status == "error" and rows[0].completion_tokens == received


def test_serve_exits_nonzero_after_its_engine_is_killed(tiny_models, tmp_path):
    serve = Serve(tmp_path, "--model", str(tiny_models["llama"]),
                  env={"LORAPLEX_MAX_MODEL_LEN": "512"})  # fmt: skip
    try:
        serve.wait_ready()
        child = _engine_child(serve.proc.pid)
        killed: list[bool] = []

        def kill_after_three(received: int) -> None:
            if not killed and received >= 3:
                os.kill(child, signal.SIGKILL)
                killed.append(True)

        events, received = _stream(serve.url, serve.key(), "llama", kill_after_three)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        rc = serve.proc.wait(30)
        assert rc == 3
        logs = serve.logs()
        assert "loraplex: error: the engine stopped" in logs, logs[-3000:]
    finally:
        serve.close()
    rows = _usage_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["status"] == "error"
    assert rows[0]["completion_tokens"] == received


@pytest.mark.parametrize("path", ["/readyz", "/healthz"])
def test_probes_stay_ok_while_the_engine_runs(tiny_models, tmp_path, path):
    with run_server(tiny_models["llama"], tmp_path) as srv:
        assert httpx.get(f"{srv.url}{path}").status_code == 200
