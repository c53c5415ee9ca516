"""The README's run command, `loraplex serve`, as a user runs it: the console script in a fresh
data dir prints a key, a curl line and an `openai` snippet that work as pasted, and the server
shuts down cleanly on Ctrl-C / SIGTERM, finishing in-flight streams and recording their usage."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loraplex.platform.demo.data import HELD_OUT
from tests.utils.server import free_port

BIN = Path(sys.executable).parent  # the venv's bin: `loraplex`, and the `python` users type


class Serve:
    """`loraplex serve --port N` in its own process; stdout collected as it comes."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        # Only what a user's shell would have: no LORAPLEX_* leaking in from the test run, and
        # no venv on PATH (the printed snippet names the venv's python itself).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != BIN]
        self.env.update(
            LORAPLEX_DATA_DIR=str(data_dir),
            PATH=os.pathsep.join(path),
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        self.log = (data_dir / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "loraplex"), "serve", "--port", str(self.port), *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.data_dir / "serve.log").read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.logs()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"serve not ready after {timeout} s:\n{self.logs()[-3000:]}")

    def printed(self, text: str, timeout: float = 30) -> None:
        """Wait until `text` is in stdout: `serve` prints its quickstart just before /readyz
        turns ready, and this process's reader thread may take a moment to pass it on."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout and time.monotonic() < deadline:
            time.sleep(0.05)

    def key(self) -> str:
        self.printed("API key (shown once)")
        found = re.search(r"API key \(shown once\): (lpx_\S+)", self.stdout)
        assert found, f"no tenant key printed:\n{self.stdout}"
        return found.group(1)

    def snippet(self, marker: str) -> str:
        """The printed command whose first line contains `marker`, continuation lines included."""
        self.printed(".message.content)")  # the quickstart's last line, printed with the rest
        lines = iter(self.lines)
        for line in lines:
            if marker in line:
                command = [line.strip()]
                while command[-1].endswith("\\"):
                    command.append(next(lines))
                return "\n".join(command)
        pytest.fail(f"no command with {marker!r} printed:\n{self.stdout}")

    def stop(self, sig: int, timeout: float = 60) -> None:
        self.proc.send_signal(sig)
        self.assert_clean_exit(sig, timeout)

    def assert_clean_exit(self, sig: int, timeout: float = 60) -> None:
        """Graceful: the app's shutdown ran, nothing crashed, and the exit status is 0 or the
        signal itself (uvicorn re-raises the signal it caught once shutdown is done, so a
        supervisor sees why the process ended)."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"serve did not exit within {timeout} s of {sig!r}:\n{self.logs()[-3000:]}")
        logs = self.logs()
        assert rc in (0, -sig, 128 + sig), f"exit status {rc}:\n{logs[-3000:]}"
        assert "Application shutdown complete" in logs, logs[-3000:]
        assert "Traceback" not in logs, logs[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _usage_rows(data_dir: Path) -> list[dict]:
    with sqlite3.connect(data_dir / "loraplex.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM usage_records ORDER BY id")]


def _shell(command: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        command, shell=True, executable="/bin/bash", env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n-> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _chat(serve: Serve, key: str, model: str, question: str) -> str:
    r = httpx.post(
        f"{serve.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 32,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def _pirate(text: str) -> bool:
    return bool(re.search(r"\b(arr|matey|ahoy|aye)\b", text.lower()))


@pytest.mark.slow
def test_readme_quickstart_works_as_printed(demo_model_dir, demo_adapters_dir, tmp_path):
    data = tmp_path / "data"
    # A fresh data dir, but the demo model converted and the demo adapters trained once per
    # machine (the same code paths `serve` runs when the folders are missing).
    (data / "models").mkdir(parents=True)
    (data / "models" / demo_model_dir.name).symlink_to(demo_model_dir, target_is_directory=True)
    (data / "demo-adapters").symlink_to(demo_adapters_dir, target_is_directory=True)
    serve = Serve(data)
    try:
        serve.wait_ready()
        key = serve.key()
        curl, python = serve.snippet("curl "), serve.snippet('-c "from openai')
        assert key in curl and key in python and f":{serve.port}/" in curl

        answer = json.loads(_shell(curl, serve.env))
        assert answer["choices"][0]["text"].strip(), answer
        assert answer["usage"]["completion_tokens"] > 0
        # The snippet asks the `pirate` demo adapter a question it was not trained on.
        printed = _shell(python, serve.env)
        assert _pirate(printed), printed

        models = httpx.get(f"{serve.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert {"pirate", "shout"} <= {m["id"] for m in models.json()["data"]}
        # Questions held out of training: the style carries over, the base model has none.
        # Each model's questions at once (the server batches them), one model after the other
        # (the usage rows' order below).
        with ThreadPoolExecutor(len(HELD_OUT)) as pool:
            base = " ".join(pool.map(lambda q: _chat(serve, key, demo_model_dir.name, q), HELD_OUT))
            shout = " ".join(pool.map(lambda q: _chat(serve, key, "shout", q), HELD_OUT))
        assert not _pirate(base), base
        assert _upper_share(shout) >= 0.8 > 0.3 > _upper_share(base), (shout, base)

        serve.stop(signal.SIGINT)  # Ctrl-C
    finally:
        serve.close()
    rows = _usage_rows(data)
    n = len(HELD_OUT)
    assert [r["status"] for r in rows] == ["ok"] * (2 + 2 * n)
    assert rows[0]["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert [r["adapter_name"] for r in rows] == [None, "pirate"] + [None] * n + ["shout"] * n


def test_sigterm_finishes_inflight_stream_and_records_usage(tiny_models, tmp_path):
    """A stream running when SIGTERM arrives is finished (uvicorn's grace period) or, on a very
    slow machine, cut at its end; either way its usage row holds what the client received."""
    serve = Serve(tmp_path, "--model", str(tiny_models["llama"]),
                  env={"LORAPLEX_MAX_MODEL_LEN": "512"})  # fmt: skip
    max_tokens = 200
    try:
        serve.wait_ready()
        body = {
            "model": "llama",
            "prompt": "The quick brown",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 0,
        }
        headers = {"Authorization": f"Bearer {serve.key()}"}
        received, at_signal, events = 0, None, []
        try:
            with httpx.stream(
                "POST", f"{serve.url}/v1/completions", json=body, headers=headers, timeout=60
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line.removeprefix("data: "))
                    if events[-1] == "[DONE]":
                        break
                    chunk = json.loads(events[-1])
                    if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                        received += len(chunk["choices"][0]["logprobs"]["tokens"])
                    if at_signal is None and received >= 3:
                        serve.proc.send_signal(signal.SIGTERM)  # what Kubernetes sends
                        at_signal = received
        except httpx.RemoteProtocolError:
            pass  # the grace period ran out and the server closed the stream
        assert at_signal is not None and received > at_signal  # it really was in flight
        finished = events[-1:] == ["[DONE]"]
        if finished:
            assert json.loads(events[-2])["usage"]["completion_tokens"] == received == max_tokens
        # New connections are refused once shutdown has begun.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{serve.url}/readyz", timeout=2).raise_for_status()
        serve.assert_clean_exit(signal.SIGTERM)
    finally:
        serve.close()
    rows = _usage_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["status"] == ("ok" if finished else "aborted")
    if finished:
        assert rows[0]["completion_tokens"] == received
    else:  # cut off, the last chunk may have left the server without reaching us
        assert received <= rows[0]["completion_tokens"] < max_tokens
